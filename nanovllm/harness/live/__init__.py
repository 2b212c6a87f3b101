"""Watch a run as it happens: a Bokeh-server dashboard in the browser (``live=web``, or ``python -m nanovllm.viz
--live RUN_DIR`` from any process) and a rich terminal view (``live=tui``).

The engine never waits for either: the run writes its files line by line as always (``records.RunWriter``),
plus, only while watched, a KV block-ownership snapshot every few steps (``blocks.jsonl``, :mod:`.snapshot`);
the dashboard is a separate process that tails those files (:mod:`.feed`), so a slow or closed browser costs
the engine nothing. The terminal view lives in the run's process but only appends to a buffer on each step;
rich redraws it from its own thread twice a second.
"""

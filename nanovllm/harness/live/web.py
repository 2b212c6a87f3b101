"""The browser dashboard: a Bokeh server application over a run's files (or a sweep's).

``serve_dashboard(run_dir, host, port)`` blocks serving ``http://host:port/``; every browser tab gets its
own document whose periodic callback (``update_ms``, 500 ms by default) tails the run through ``RunFeed`` and
streams the new rows into the charts' ``ColumnDataSource``s. Nothing here runs in the engine's process:
``live=web`` starts this module as a child process (:mod:`.launch`), and ``python -m nanovllm.viz --live
RUN_DIR`` runs it by hand, e.g. behind ``ssh -L PORT:127.0.0.1:PORT`` for a run on another machine.

The time slider follows the run while it grows; drag it back to see the run as it was at that moment (the
block map, the Gantt rows and the latency table are recomputed for that time), and press "follow" to return.

A cluster's run (steps that carry ``replica``) adds a row of per-replica charts: each replica's running
requests and KV usage, one line a replica; the batch and KV charts above show the sums over replicas.

A run that decodes speculatively (``speculative=...``) adds two rows: the acceptance rate and the mean accepted
length over a rolling window, proposed and accepted tokens per step, and the acceptance per proposal position
so far. Their per-step source keeps the last ``SPEC_ROLLOVER`` steps (older ones scroll out), so a long run
costs the browser a bounded amount; the per-position counts are a few running sums.

A run with KV tiers below its pool (``kv_offload=...``) adds a row: what each tier holds over time (one line a
tier: the fraction of its capacity, or MiB where a capacity is not stated) and the MiB loaded from and written
to each tier per step, under a line of each tier's totals (hit rate, MiB loaded and written, load time). Each
tier's source keeps the last ``TIER_ROLLOVER`` steps; the totals are running sums (``TierTotals``).
"""

from __future__ import annotations

import errno
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from bokeh.application import Application
from bokeh.application.handlers.function import FunctionHandler
from bokeh.document import Document
from bokeh.layouts import column, row
from bokeh.models import (
    Button,
    ColumnDataSource,
    DataTable,
    Div,
    HoverTool,
    NumberFormatter,
    Slider,
    Span,
    TableColumn,
)
from bokeh.palettes import Category10, Category20
from bokeh.plotting import figure
from bokeh.server.server import Server
from bokeh.transform import factor_cmap

from nanovllm.harness.live.launch import free_port
from nanovllm.harness.live.feed import (
    BLOCK_COLUMNS,
    GANTT_COLUMNS,
    LATENCY_COLUMNS,
    PHASES,
    POSITION_COLUMNS,
    REPLICA_COLUMNS,
    SPEC_COLUMNS,
    STEP_COLUMNS,
    TIER_COLUMNS,
    RunFeed,
    SpecTotals,
    TierTotals,
    block_map,
    check_run_dir,
    gantt_rows,
    has_tiers,
    latency_table,
    replica_columns,
    spec_columns,
    speculating,
    step_columns,
    sweep_runs,
    tier_columns,
)

PHASE_COLORS = ("#bbbbbb", "#e4572e", "#4c72b0", "#f2a900", "#59a14f", "#222222")
WIDTH = 640
#: Steps the speculation charts keep in the browser (and in their source): the latest, older ones scroll out.
SPEC_ROLLOVER = 2000
#: Seconds over which the acceptance rate and mean accepted length are computed, from at most the
#: ``SPEC_HISTORY`` steps before the new ones (a window of very short steps is cut there).
SPEC_WINDOW = 5.0
SPEC_HISTORY = 2000
#: Steps each KV tier's charts keep in the browser (and in its source): the latest, older ones scroll out.
TIER_ROLLOVER = 2000


def _empty(names: tuple[str, ...]) -> dict[str, list]:
    return {name: [] for name in names}


def _time_figure(title: str, y_label: str, **kw: Any):
    fig = figure(title=title, height=230, width=WIDTH, x_axis_label="time since run start (s)",
                 y_axis_label=y_label, tools="pan,xwheel_zoom,box_zoom,reset,save", **kw)
    fig.toolbar.logo = None
    return fig


def _tier_bars(columns: dict[str, dict[str, list]]) -> dict[str, dict[str, list]]:
    """``tier_columns`` with ``mib_written_down`` (MiB written, negated): the moves chart draws writes below 0."""
    for data in columns.values():
        data["mib_written_down"] = [-mib for mib in data["mib_written"]]
    return columns


class RunDashboard:
    """One browser tab's view of one run: the sources, the charts, and the callback that keeps them fresh."""

    def __init__(self, run_dir: Path, update_ms: int = 500) -> None:
        self.feed = RunFeed(run_dir)
        self.update_ms = update_ms
        self.following = True
        self.moment = 0.0
        self.steps_src = ColumnDataSource(_empty(STEP_COLUMNS))
        self.preempt_src = ColumnDataSource({"t": [], "preempted": [], "kv_used": []})
        self.gantt_src = ColumnDataSource(_empty(GANTT_COLUMNS))
        self.blocks_src = ColumnDataSource(_empty(BLOCK_COLUMNS + ("color", "line")))
        self.latency_src = ColumnDataSource(_empty(LATENCY_COLUMNS))
        self.header = Div(text="", width=2 * WIDTH)
        self.notice = Div(text="", width=2 * WIDTH, styles={"color": "#a33"})
        self.slider = Slider(start=0, end=1, value=1, step=0.01, title="time (s)", width=WIDTH, disabled=True)
        self.follow_button = Button(label="follow live", width=120, button_type="primary")
        self.cursors: list[Span] = []
        self.replica_srcs: dict[int, ColumnDataSource] = {}   # a cluster's replicas, as their steps appear
        self.spec_src = ColumnDataSource(_empty(SPEC_COLUMNS))
        self.position_src = ColumnDataSource(_empty(POSITION_COLUMNS))
        self.spec_totals = SpecTotals()   # over the steps shown: the per-position chart and the spec header
        self.spec_header = Div(text="", width=2 * WIDTH)
        self.tier_srcs: dict[str, ColumnDataSource] = {}   # per KV tier, as its steps appear
        self.tier_totals = TierTotals()   # over the steps shown: the tier section's header
        self.tier_header = Div(text="", width=2 * WIDTH)
        self._tier_by_fraction = False   # set with the first tier's lines (``_tier_source``)
        self._shown_steps = 0
        self._rows_key: tuple = ()
        self.moment = 0.0  # the time shown while not following

    # -- layout -------------------------------------------------------------------------------------------------
    def layout(self):
        self.slider.on_change("value_throttled", self._on_scrub)
        self.follow_button.on_click(self._on_follow)
        charts = [self._batch_chart(), self._kv_chart(), self._composition_chart(), self._throughput_chart()]
        return column(
            self.header, self.notice, row(self.slider, self.follow_button),
            row(charts[0], charts[1]), row(charts[2], charts[3]),
            self._replica_charts(), self._spec_charts(), self._tier_charts(),
            row(self._gantt_chart(), column(self._block_chart(), self._latency_table())),
        )

    def _replica_charts(self):
        self.replica_batch = _time_figure("per replica: running requests", "requests")
        self.replica_kv = _time_figure("per replica: KV cache usage (blocks used / its total)", "fraction",
                                       y_range=(0, 1.05))
        for fig in (self.replica_batch, self.replica_kv):
            self._cursor(fig)
        self.replica_row = row(self.replica_batch, self.replica_kv, visible=False)  # shown for a cluster
        return self.replica_row

    def _spec_charts(self):
        """The speculation rows, hidden until the run is known to speculate (``speculating``)."""
        rate = _time_figure(f"speculation: acceptance rate ({SPEC_WINDOW:g} s window)", "accepted / proposed",
                            y_range=(0, 1.05))
        rate.line("t", "acceptance_rate", source=self.spec_src, color=PHASE_COLORS[4], line_width=2)
        rate.add_tools(HoverTool(tooltips=[("t", "@t{0.00} s"), ("acceptance", "@acceptance_rate{0.00}")],
                                 mode="vline"))
        length = _time_figure(f"speculation: mean accepted length ({SPEC_WINDOW:g} s window)",
                              "tokens / verification")
        length.line("t", "mean_accepted_length", source=self.spec_src, color=PHASE_COLORS[2], line_width=2)
        length.add_tools(HoverTool(tooltips=[("t", "@t{0.00} s"), ("mean accepted length",
                                                                   "@mean_accepted_length{0.00}")], mode="vline"))
        tokens = _time_figure("speculation: proposed vs accepted tokens per step", "tokens / step")
        for name, color in (("proposed", PHASE_COLORS[0]), ("accepted", PHASE_COLORS[4])):
            tokens.step("t", name, source=self.spec_src, mode="after", color=color, legend_label=name, line_width=2)
        tokens.legend.location = "top_left"
        tokens.legend.background_fill_alpha = 0.6
        tokens.legend.click_policy = "hide"
        tokens.add_tools(HoverTool(tooltips=[("step", "@step"), ("proposed", "@proposed"), ("accepted", "@accepted"),
                                            ("verifications", "@drafts")], mode="vline",
                                   renderers=tokens.renderers[:1]))
        for fig in (rate, length, tokens):
            self._cursor(fig)
        positions = figure(title="speculation: acceptance per proposal position (so far)", height=230, width=WIDTH,
                           x_axis_label="position in the proposal (1 = first)",
                           y_axis_label="accepted / verifications", y_range=(0, 1.05), tools="reset,save",
                           tooltips=[("position", "@position"), ("accepted", "@accepted of @drafts"),
                                     ("rate", "@rate{0.00}")])
        positions.toolbar.logo = None
        positions.vbar(x="position", top="rate", width=0.7, source=self.position_src, color=PHASE_COLORS[2])
        positions.xaxis.ticker.desired_num_ticks = 8
        self.spec_section = column(self.spec_header, row(rate, length), row(tokens, positions), visible=False)
        return self.spec_section

    def _reveal(self, section, present: Callable[[list[dict], Any], bool], steps: list[dict],
                replace: bool) -> tuple[bool, list[dict]] | None:
        """A section shown only for some runs (speculation, KV tiers): None while it stays hidden, else how to
        draw ``steps`` into it, ``(replace, steps)``. While hidden, ``present(steps, sizes)`` looks at the steps
        not seen before (had an earlier one shown the feature, the section would be visible already); revealed
        while following, it draws every step shown so far, not only the new ones."""
        if section.visible:
            return replace, steps
        if not present(steps, self.feed.sizes):
            return None
        section.visible = True
        if replace:
            return replace, steps
        return True, self.feed.steps_between(0, self._shown_steps + len(steps))

    def _show_spec(self, steps: list[dict], history: list[dict], replace: bool) -> None:
        """Stream (or, after a scrub, replace with) the speculation rows of ``steps``; reveal the charts once the
        run is known to speculate."""
        revealed = self._reveal(self.spec_section, speculating, steps, replace)
        if revealed is None:
            return
        replace, steps = revealed
        if replace:
            self.spec_totals = SpecTotals()
            self.spec_totals.add(steps)
            cut = max(0, len(steps) - SPEC_ROLLOVER)
            self.spec_src.data = spec_columns(steps[cut:], steps[max(0, cut - SPEC_HISTORY):cut], SPEC_WINDOW)
        else:
            self.spec_totals.add(steps)
            self.spec_src.stream(spec_columns(steps, history, SPEC_WINDOW), rollover=SPEC_ROLLOVER)
        self.position_src.data = self.spec_totals.positions(self.feed.sizes.num_speculative_tokens)
        totals = self.spec_totals
        rate = f"{totals.accepted / totals.proposed:.2f}" if totals.proposed else "n/a"
        length = f"{1 + totals.accepted / totals.drafts:.2f}" if totals.drafts else "n/a"
        k = self.feed.sizes.num_speculative_tokens
        self.spec_header.text = (
            f"<b>speculative decoding</b>{f' (K = {k})' if k else ''} · proposed "
            f"<span class='nv-proposed'>{totals.proposed}</span> · accepted "
            f"<span class='nv-accepted'>{totals.accepted}</span> · acceptance rate "
            f"<span class='nv-acceptance'>{rate}</span> · mean accepted length "
            f"<span class='nv-accepted-length'>{length}</span>")

    def _tier_charts(self):
        """The KV tier row, hidden until the run is known to have tiers (``has_tiers``); a tier's lines are drawn
        when its steps first appear (``_tier_source``)."""
        self.tier_held = _time_figure("KV tiers: what each tier holds", "fraction of its capacity")
        self.tier_moves = _time_figure("KV tiers: MiB loaded from each tier (up) and written to it (down) per step",
                                       "MiB / step")
        for fig in (self.tier_held, self.tier_moves):
            self._cursor(fig)
        self.tier_section = column(self.tier_header, row(self.tier_held, self.tier_moves), visible=False)
        return self.tier_section

    def _tier_source(self, name: str) -> ColumnDataSource:
        """The tier's source, with its lines drawn the first time its steps appear (``_add_tier_lines``)."""
        source = self.tier_srcs.get(name)
        if source is not None:
            return source
        document = self.tier_held.document
        # Each glyph added to a document's figure recomputes its whole model graph; the tier's four changes
        # (lines, hover tools, legends) are one recomputation this way.
        with document.models.freeze() if document is not None else nullcontext():
            return self._add_tier_lines(name)

    def _add_tier_lines(self, name: str) -> ColumnDataSource:
        """A source for tier ``name`` and its lines and hovers. Occupancy is drawn as the fraction of each tier's
        capacity when the run states every tier's, else in MiB (one axis for all, chosen with the first tier)."""
        if not self.tier_srcs:   # the first tier: choose the occupancy axis for all
            capacities = self.feed.sizes.kv_tiers or {}
            self._tier_by_fraction = bool(capacities) and all(capacities.values()) and name in capacities
            if not self._tier_by_fraction:
                self.tier_held.yaxis.axis_label = "MiB held"
        source = self.tier_srcs[name] = ColumnDataSource(_empty(TIER_COLUMNS + ("mib_written_down",)))
        color = Category10[10][(len(self.tier_srcs) - 1) % 10]
        # A tier holds what it held after a step until the next one: a step line, not a ramp between steps.
        held = self.tier_held.step("t", "fraction" if self._tier_by_fraction else "mib", source=source, mode="after",
                                   color=color, legend_label=name, line_width=2)
        self.tier_held.add_tools(HoverTool(tooltips=[("tier", name), ("t", "@t{0.00} s"), ("blocks", "@blocks"),
                                                     ("held", "@mib{0.0} MiB (@fraction{0.0%} of capacity)")],
                                           mode="vline", renderers=[held]))
        # One bar per step that moved something (steps are far apart while the run idles: a line would ramp).
        loaded = self.tier_moves.vbar(x="t", top="mib_loaded", width=0.02, source=source, color=color,
                                      legend_label=f"{name} loaded")
        self.tier_moves.vbar(x="t", top=0, bottom="mib_written_down", width=0.02, source=source, color=color,
                             alpha=0.5, legend_label=f"{name} written")
        self.tier_moves.add_tools(HoverTool(tooltips=[
            ("tier", name), ("step", "@step"), ("loaded", "@blocks_loaded blocks (@mib_loaded{0.00} MiB)"),
            ("written", "@blocks_written blocks (@mib_written{0.00} MiB)"), ("hit tokens", "@hit_tokens")],
            mode="vline", renderers=[loaded]))
        for fig in (self.tier_held, self.tier_moves):
            fig.legend.location = "top_left"
            fig.legend.background_fill_alpha = 0.6
            fig.legend.click_policy = "hide"
        return source

    def _show_tiers(self, steps: list[dict], history: list[dict], replace: bool) -> None:
        """Stream (or, after a scrub, replace with) the tier rows of ``steps`` (``history``: the steps before
        them, for a cluster's holdings); reveal the row once the run is known to have tiers."""
        revealed = self._reveal(self.tier_section, has_tiers, steps, replace)
        if revealed is None:
            return
        replace, steps = revealed
        if replace:
            self.tier_totals = TierTotals()
            self.tier_totals.add(steps)
            cut = max(0, len(steps) - TIER_ROLLOVER)
            columns = _tier_bars(tier_columns(steps[cut:], self.feed.sizes, steps[max(0, cut - TIER_ROLLOVER):cut]))
            for name, source in self.tier_srcs.items():
                source.data = columns.pop(name, _tier_bars({name: _empty(TIER_COLUMNS)})[name])
            for name, data in columns.items():
                self._tier_source(name).data = data
        else:
            self.tier_totals.add(steps)
            for name, data in _tier_bars(tier_columns(steps, self.feed.sizes, history)).items():
                self._tier_source(name).stream(data, rollover=TIER_ROLLOVER)
        figures = " | ".join(self._tier_text(name) for name in self.tier_totals.counts)
        self.tier_header.text = f"<b>KV tiers</b> · {figures or 'waiting for the first step'}"

    def _tier_text(self, name: str) -> str:
        """One tier's headline, its figures in spans a browser test can read (``nv-tier-*``)."""
        capacity = (self.feed.sizes.kv_tiers or {}).get(name)
        f = self.tier_totals.figures(name, capacity)
        share = f" = {f['fraction']:.1%} of {capacity / 2**20:.1f} MiB" if f["fraction"] is not None and capacity \
            else ""
        rate = f"{f['hit_rate']:.2f}" if f["hit_rate"] is not None else "n/a"
        return (f"<b class='nv-tier-name'>{name}</b> holds <span class='nv-tier-blocks'>{f['blocks']:.0f}</span> "
                f"blocks ({f['mib']:.1f} MiB{share}) · hit rate <span class='nv-tier-hit'>{rate}</span> "
                f"({f['hit_tokens']:.0f} tokens) · loaded <span class='nv-tier-loaded'>{f['mib_loaded']:.2f}</span> "
                f"MiB ({f['blocks_loaded']:.0f} blocks, {(f['load_seconds'] or 0.0) * 1000:.1f} ms) · written "
                f"<span class='nv-tier-written'>{f['mib_written']:.2f}</span> MiB ({f['blocks_written']:.0f} blocks)")

    def _replica_source(self, replica: int) -> ColumnDataSource:
        """The replica's source, with its two lines drawn the first time its steps appear."""
        source = self.replica_srcs.get(replica)
        if source is None:
            source = self.replica_srcs[replica] = ColumnDataSource(_empty(REPLICA_COLUMNS))
            color = Category10[10][replica % 10]
            label = f"replica {replica}"
            self.replica_batch.step("t", "running", source=source, mode="after", color=color, legend_label=label)
            self.replica_kv.line("t", "kv_usage", source=source, color=color, legend_label=label)
            for fig in (self.replica_batch, self.replica_kv):
                fig.legend.location = "top_left"
                fig.legend.background_fill_alpha = 0.6
                fig.legend.click_policy = "hide"
            self.replica_row.visible = True
        return source

    def _show_replicas(self, steps: list[dict], replace: bool) -> None:
        columns = replica_columns(steps)
        if replace:
            for replica, source in self.replica_srcs.items():
                source.data = columns.pop(replica, _empty(REPLICA_COLUMNS))
        for replica, data in sorted(columns.items()):
            self._replica_source(replica).stream(data, rollover=self.feed.window)

    def _cursor(self, fig) -> None:
        span = Span(location=0, dimension="height", line_color="#888", line_dash="dashed", visible=False)
        fig.add_layout(span)
        self.cursors.append(span)

    def _batch_chart(self):
        fig = _time_figure("batch: running / waiting requests, max_num_seqs", "requests")
        for name, color in (("running", PHASE_COLORS[2]), ("waiting", PHASE_COLORS[1])):
            fig.step("t", name, source=self.steps_src, mode="after", color=color, legend_label=name, line_width=2)
        fig.line("t", "max_num_seqs", source=self.steps_src, color="black", line_dash="dotted",
                 legend_label="max_num_seqs")
        fig.scatter("t", "preempted", source=self.preempt_src, marker="x", size=9, color=PHASE_COLORS[3],
                    legend_label="preempted this step")
        fig.legend.location = "top_left"
        fig.legend.background_fill_alpha = 0.6
        fig.legend.click_policy = "hide"
        fig.add_tools(HoverTool(tooltips=[("step", "@step"), ("t", "@t{0.00} s"), ("running", "@running"),
                                          ("waiting", "@waiting")], mode="vline", renderers=fig.renderers[:1]))
        self._cursor(fig)
        return fig

    def _kv_chart(self):
        fig = _time_figure("KV cache: blocks used / cached / free (preemptions marked)", "blocks")
        fig.varea_stack(["kv_used", "kv_cached", "kv_free"], x="t", source=self.steps_src,
                        color=[PHASE_COLORS[2], "#9ecae1", "#eeeeee"], legend_label=["used", "cached", "free"])
        fig.scatter("t", "kv_used", source=self.preempt_src, marker="triangle", size=9, color=PHASE_COLORS[3],
                    legend_label="preemption")
        fig.legend.location = "top_left"
        fig.legend.background_fill_alpha = 0.6
        fig.legend.click_policy = "hide"
        fig.add_tools(HoverTool(tooltips=[("t", "@t{0.00} s"), ("used", "@kv_used blocks (@kv_used_mib{0.0} MiB)"),
                                          ("cached", "@kv_cached blocks (@kv_cached_mib{0.0} MiB)"),
                                          ("free", "@kv_free blocks (@kv_free_mib{0.0} MiB)")], mode="vline",
                                renderers=fig.renderers[:1]))
        self._cursor(fig)
        return fig

    def _composition_chart(self):
        fig = _time_figure("batch composition: prefill tokens, decode seqs, token budget", "tokens / step")
        fig.vbar_stack(["prefill_tokens", "decode_seqs"], x="t", width=0.02, source=self.steps_src,
                       color=[PHASE_COLORS[1], PHASE_COLORS[2]], legend_label=["prefill tokens", "decode seqs"])
        fig.line("t", "token_budget", source=self.steps_src, color="black", line_dash="dotted",
                 legend_label="max_num_batched_tokens")
        fig.legend.location = "top_left"
        fig.legend.background_fill_alpha = 0.6
        fig.legend.click_policy = "hide"
        self._cursor(fig)
        return fig

    def _throughput_chart(self):
        fig = _time_figure("output throughput (2 s window)", "tokens / s")
        fig.line("t", "throughput", source=self.steps_src, color=PHASE_COLORS[4], line_width=2)
        self._cursor(fig)
        return fig

    def _gantt_chart(self):
        fig = figure(title="requests (rows by priority, then arrival): queued, prefill, decoding, preempted",
                     height=700, width=WIDTH, y_range=[], x_axis_label="time since run start (s)",
                     tools="pan,xwheel_zoom,reset,save")
        fig.toolbar.logo = None
        fig.hbar(y="row", left="start", right="end", height=0.7, source=self.gantt_src,
                 color=factor_cmap("phase", PHASE_COLORS, PHASES), legend_field="phase")
        fig.add_tools(HoverTool(tooltips=[
            ("request", "@request_id (priority @priority, client @client)"), ("phase", "@phase"),
            ("span", "@start{0.000} - @end{0.000} s"), ("tokens", "@prompt_tokens in, @output_tokens out"),
            ("preemptions", "@preemptions"), ("TTFT", "@ttft_ms{0.0} ms"), ("E2EL", "@e2el_ms{0.0} ms")]))
        fig.legend.location = "top_left"
        fig.legend.background_fill_alpha = 0.6
        fig.legend.click_policy = "hide"
        fig.legend.orientation = "horizontal"
        fig.legend.background_fill_alpha = 0.6
        fig.yaxis.major_label_text_font_size = "7pt"
        self.gantt = fig
        self._cursor(fig)
        return fig

    def _block_chart(self):
        fig = figure(title="KV block map (now): colour = owning request, black edge = shared (prefix)", height=300,
                     width=WIDTH, tools="hover,reset", tooltips=[("block", "@block"), ("held by", "@owners"),
                                                                ("state", "@state")],
                     x_range=(-0.5, 31.5), y_range=(11.5, -0.5))
        fig.toolbar.logo = None
        fig.rect("x", "y", 0.92, 0.92, source=self.blocks_src, fill_color="color", line_color="line", line_width=2)
        fig.axis.visible = False
        fig.grid.visible = False
        self.block_fig = fig
        return fig

    def _latency_table(self):
        fmt = NumberFormatter(format="0.0")
        columns = [TableColumn(field="group", title="group", width=110)] + [
            TableColumn(field=name, title=name.replace("_ms", "").replace("_", " "), formatter=fmt, width=60)
            for name in LATENCY_COLUMNS[1:]]
        return DataTable(source=self.latency_src, columns=columns, width=WIDTH, height=180, index_position=None)

    # -- updates ------------------------------------------------------------------------------------------------
    def update(self) -> None:
        """Periodic callback: read what the run appended, stream it in, refresh the per-moment views."""
        new_steps, new_requests, new_snapshots = self.feed.poll()
        end = self.feed.end_time
        if end > 0:
            self.slider.disabled = False
            self.slider.end = max(end, 0.01)
        if self.following:
            self.slider.value = self.slider.end
            if new_steps:
                self._stream_steps(self.feed.steps_between(self._shown_steps))
            if new_steps or new_requests or new_snapshots:
                self._show_moment(end, blocks=bool(new_snapshots), latency=bool(new_requests))
        self._refresh_header()

    def _stream_steps(self, steps: list[dict]) -> None:
        history = self.feed.steps_between(self._shown_steps - 400, self._shown_steps)
        # rollover: the charts keep the feed's rolling window of steps, however long the run
        self.steps_src.stream(step_columns(steps, self.feed.sizes, history), rollover=self.feed.window)
        self._show_replicas(steps, replace=False)
        self._show_spec(steps, self.feed.steps_between(self._shown_steps - SPEC_HISTORY, self._shown_steps),
                        replace=False)
        self._show_tiers(steps, history, replace=False)
        marks = [s for s in steps if s["num_preempted"]]
        if marks:
            self.preempt_src.stream({"t": [s["start_time"] + s["duration"] for s in marks],
                                     "preempted": [s["num_preempted"] for s in marks],
                                     "kv_used": [s["kv_blocks_used"] for s in marks]}, rollover=self.feed.window)
        self._shown_steps += len(steps)

    def _show_moment(self, t: float, blocks: bool = True, latency: bool = True) -> None:
        """Gantt rows, and the block map and latency table unless told they have not changed, as at ``t``."""
        gantt = gantt_rows(self.feed, t)
        rows = list(dict.fromkeys(gantt["row"]))
        if tuple(rows) != self._rows_key:
            self.gantt.y_range.factors = rows
            self._rows_key = tuple(rows)
        self.gantt_src.data = gantt
        if blocks:
            self._show_blocks(t)
        if latency:
            self.latency_src.data = latency_table(self.feed.requests_ended_by(t))

    def _show_blocks(self, t: float) -> None:
        snapshot = self.feed.snapshot_at(t)
        num_blocks = self.feed.sizes.num_kv_blocks or 0
        blocks = block_map(snapshot, num_blocks)
        # Owners cycle through the palette in the order they appear, so neighbours differ; hover gives the id.
        palette = Category20[20]
        order = {rid: palette[i % 20] for i, rid in enumerate(dict.fromkeys(o for o in blocks["owner"] if o))}
        blocks["color"] = [order.get(o, "#eeeeee") for o in blocks["owner"]]
        blocks["line"] = ["black" if state == "shared" else "rgba(0,0,0,0)" for state in blocks["state"]]
        self.blocks_src.data = blocks
        rows = -(-num_blocks // 32)
        self.block_fig.x_range.start, self.block_fig.x_range.end = -0.5, 31.5
        self.block_fig.y_range.start, self.block_fig.y_range.end = max(rows, 12) - 0.5, -0.5

    def _refresh_header(self) -> None:
        feed = self.feed
        total = feed.sizes.num_requests
        done = feed.num_requests_seen
        state = "finished" if feed.finished else "running" if feed.steps else "starting (loading the model)"
        last = feed.steps[-1]["step"] if feed.steps else 0
        self.header.text = (
            f"<b>nano-vllm live</b> · <code>{feed.run_dir}</code> · run <span class='nv-state'>{state}</span> · "
            f"step <span class='nv-step'>{last}</span> · t = {feed.end_time:.2f} s · finished requests "
            f"<span class='nv-finished'>{done}</span>{f' / {total}' if total else ''}"
            + ("" if self.following else f" · <b>showing t = {self.moment:.2f} s</b>"))
        problems = []
        if feed.finished and feed.torn_files:
            problems.append(f"{', '.join(feed.torn_files)} end with an incomplete line (skipped)")
        if feed.bad_lines:
            problems.append(f"{feed.bad_lines} unreadable line(s) skipped")
        self.notice.text = "; ".join(problems)

    def _on_scrub(self, attr: str, old: float, new: float) -> None:
        if new >= self.slider.end - 1e-9:
            self._on_follow()
            return
        self.following = False
        self.moment = new
        steps = self.feed.steps_until(new)
        self.steps_src.data = step_columns(steps, self.feed.sizes)
        self._show_replicas(steps, replace=True)
        self._show_spec(steps, [], replace=True)
        self._show_tiers(steps, [], replace=True)
        marks = [s for s in steps if s["num_preempted"]]
        self.preempt_src.data = {"t": [s["start_time"] + s["duration"] for s in marks],
                                 "preempted": [s["num_preempted"] for s in marks],
                                 "kv_used": [s["kv_blocks_used"] for s in marks]}
        self._shown_steps = self.feed.first_step_index + len(steps)
        for span in self.cursors:
            span.location, span.visible = new, True
        self._show_moment(new)
        self._refresh_header()

    def _on_follow(self) -> None:
        self.following = True
        for span in self.cursors:
            span.visible = False
        self._stream_steps(self.feed.steps_between(self._shown_steps))
        self.slider.value = self.slider.end
        self._show_moment(self.feed.end_time)
        self._refresh_header()


class SweepDashboard:
    """A multirun directory: one summary table row per job and their latency CDFs side by side."""

    SUMMARY_KEYS = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                    "p99_tpot_ms", "median_itl_ms", "num_preemptions", "peak_kv_usage")

    def __init__(self, sweep_dir: Path) -> None:
        self.sweep_dir = sweep_dir
        self.table_src = ColumnDataSource({"run": [], **{k: [] for k in self.SUMMARY_KEYS}})
        self.cdf_srcs = {name: ColumnDataSource({"x": [], "y": [], "run": [], "color": []})
                         for name in ("TTFT", "TPOT", "E2EL")}
        self.header = Div(text="", width=2 * WIDTH)
        self._seen: tuple = ()

    def layout(self):
        fmt = NumberFormatter(format="0.00")
        table = DataTable(source=self.table_src, width=3 * 420, height=260, index_position=None, columns=[
            TableColumn(field="run", title="run", width=220)] + [
            TableColumn(field=k, title=k.replace("_", " "), formatter=fmt) for k in self.SUMMARY_KEYS])
        figs = []
        for name, source in self.cdf_srcs.items():
            fig = figure(title=f"{name} CDF", width=420, height=320, x_axis_label=f"{name} (ms)",
                         y_axis_label="fraction of requests", tools="pan,wheel_zoom,reset,save,hover",
                         tooltips=[("run", "@run"), (name, "@x{0.0} ms"), ("fraction", "@y{0.00}")])
            fig.toolbar.logo = None
            fig.multi_line("x", "y", source=source, color="color", legend_field="run", line_width=2)
            fig.legend.location = "bottom_right"
            figs.append(fig)
        return column(self.header, table, row(*figs))

    def update(self) -> None:
        # The plotting module imports matplotlib (its font cache is built on first import): only a sweep needs it.
        from nanovllm.harness.viz.plots import e2els, load_run, run_labels, tpots, ttfts

        jobs = sweep_runs(self.sweep_dir)
        seen = tuple((p.name, (p / "metrics.json").is_file()) for p in jobs)
        if seen == self._seen:
            return
        self._seen = seen
        runs = [load_run(p, label) for p, label in zip(jobs, run_labels(jobs))] if jobs else []
        runs = [run for run in runs if run.metrics]
        self.table_src.data = {"run": [r.label for r in runs],
                               **{k: [r.summary.get(k) for r in runs] for k in self.SUMMARY_KEYS}}
        palette = Category10[10]
        for name, metric in (("TTFT", ttfts), ("TPOT", tpots), ("E2EL", e2els)):
            data: dict[str, list] = {"x": [], "y": [], "run": [], "color": []}
            for i, run in enumerate(runs):
                values = sorted(v * 1000 for v in metric(run.requests))
                if values:
                    data["x"].append(values)
                    data["y"].append([(k + 1) / len(values) for k in range(len(values))])
                    data["run"].append(run.label)
                    data["color"].append(palette[i % 10])
            self.cdf_srcs[name].data = data
        self.header.text = (f"<b>nano-vllm sweep</b> · <code>{self.sweep_dir}</code> · "
                            f"<span class='nv-jobs'>{len(runs)}</span> of {len(jobs)} jobs finished")


def make_app(run_dir: Path, update_ms: int = 500, starting: bool = False) -> Callable[[Document], None]:
    """The Bokeh document factory for ``run_dir`` (a run or a multirun directory; ``starting``: a run whose
    files are not there yet)."""
    run_dir = check_run_dir(run_dir, starting)

    def build(doc: Document) -> None:
        view: RunDashboard | SweepDashboard
        if sweep_runs(run_dir) and not (run_dir / "steps.jsonl").is_file():
            view = SweepDashboard(run_dir)
            interval = 2000
        else:
            view = RunDashboard(run_dir, update_ms)
            interval = update_ms
        doc.add_root(view.layout())
        doc.title = f"nano-vllm live: {run_dir.name}"
        view.update()
        doc.add_periodic_callback(view.update, interval)

    return build


class PortInUseError(OSError):
    """The dashboard's port is taken."""


def start_server(run_dir: Path, host: str = "127.0.0.1", port: int = 5006, update_ms: int = 500,
                 starting: bool = False) -> Server:
    """A started (not yet looping) Bokeh server for ``run_dir``; ``PortInUseError`` names the port if taken.
    Port 0 picks a free one (read it back from ``server.port``)."""
    if port == 0:
        port = free_port(host, 0) or 0
    app = Application(FunctionHandler(make_app(Path(run_dir), update_ms, starting)))
    try:
        server = Server({"/": app}, address=host, port=port, allow_websocket_origin=[f"{host}:{port}",
                        f"localhost:{port}", f"127.0.0.1:{port}"], num_procs=1)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is in use; choose another (live.port=... or --port)") from exc
        raise
    server.start()
    return server


def serve_dashboard(run_dir: Path, host: str = "127.0.0.1", port: int = 5006, update_ms: int = 500,
                    starting: bool = False) -> None:
    """Serve the dashboard of ``run_dir`` until interrupted; prints its URL first."""
    server = start_server(run_dir, host, port, update_ms, starting)
    print(f"live dashboard: http://{host}:{server.port}/  (Ctrl-C to stop)", flush=True)
    try:
        server.io_loop.start()
    except KeyboardInterrupt:
        print("live dashboard stopped", file=sys.stderr)

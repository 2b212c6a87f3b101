"""What the test modules share: requests, a bare scheduler stepped as the engine steps it, plain run records,
model-free serving through ``runner=sim`` (the engine, the serving loop, records and summary of every run), and
small random-weight models saved as model directories.

Two ways to test a scheduling decision without the model, and when to use which:

* ``bare_scheduler`` + ``run_step`` / ``drive``: the ``Scheduler`` alone, stepped by hand at times the test chooses. For
  its mechanics (budgets, admission, preemption, block accounting) and for asserting on live ``Request`` state.
* ``simulate``: a workload served by the real engine on the simulated runner and the ``token_cost`` step-time
  model (``clock="steps"``: every step lasts 1; ``"tokens"``: 16 + the tokens it computes), returning the
  ``RunResult`` any run returns. For a policy's effect on latencies, hit rates and goodput.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from nanovllm import ALLOCATORS, POLICIES, Request, SamplingParams
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput

REPO = Path(__file__).resolve().parent.parent   # the checkout: conf/, experiments/, nanovllm/
SAMPLED_TOKEN = 7   # what a bare scheduler's "model" samples, every time


# -- requests -----------------------------------------------------------------------------------------------------

def make_request(rid: str = "r", prompt: int | Sequence[int] = 4, max_tokens: int = 4, *, arrival: float = 0.0,
                 priority: int = 0, client: str | None = None, start: int = 1, slo_ttft: float | None = None,
                 slo_e2el: float | None = None, **params: Any) -> Request:
    """A ``Request`` as the engine would make it. ``prompt``: token ids, or a length ``n`` (ids ``start`` ..
    ``start + n - 1``). ``params`` are ``SamplingParams`` fields; ``ignore_eos`` is True unless given."""
    token_ids = list(range(start, start + prompt)) if isinstance(prompt, int) else list(prompt)
    params.setdefault("ignore_eos", True)
    return Request(rid, token_ids, SamplingParams(max_tokens=max_tokens, **params), arrival_time=arrival,
                   priority=priority, client_id=client, slo_ttft=slo_ttft, slo_e2el=slo_e2el)


def block_tokens(*blocks: int) -> list[int]:
    """A prompt of one 4-token block per argument (block ``b`` holds b*10 .. b*10+3), then a last token of its
    own: prompts that share exactly the blocks they name, for the prefix caches."""
    return [b * 10 + i for b in blocks for i in range(4)] + [999]


# -- a bare scheduler ---------------------------------------------------------------------------------------------

def bare_scheduler(policy: Any = "fcfs", allocator: str = "paged", num_blocks: int = 64, block_size: int = 4,
              max_num_seqs: int = 4, max_num_batched_tokens: int = 64, **options: Any) -> Scheduler:
    """A ``Scheduler`` with a registered policy (a name, a ``{"name": ...}`` spec or an instance) and allocator;
    ``options``: ``enable_chunked_prefill``, ``watermark``."""
    return Scheduler(POLICIES.build(policy), ALLOCATORS.build(allocator, num_blocks, block_size),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, **options)


def sampled(out: SchedulerOutput, token: int = SAMPLED_TOKEN) -> list[int | None]:
    """What the model runner would return: a token for each request whose chunk reaches its newest token."""
    return [token if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled]


def run_step(scheduler: Scheduler, now: float, token: int = SAMPLED_TOKEN) -> tuple[SchedulerOutput, list[Request]]:
    """One step as the engine runs it (plan, sample, update) at time ``now``: its plan and what ended in it."""
    out = scheduler.schedule(now)
    return out, scheduler.update_from_output(out, sampled(out, token), now, max_model_len=10**9)


def drive(scheduler: Scheduler, max_steps: int = 10_000) -> tuple[int, dict[str, int]]:
    """Step at times 0, 1, 2, ... until nothing is unfinished, checking the budgets every step; returns the
    number of steps and the step of each request's first token."""
    first_token_step: dict[str, int] = {}
    for number in range(max_steps):
        if not scheduler.has_unfinished():
            return number, first_token_step
        out, _ = run_step(scheduler, float(number))
        assert out.scheduled, "the scheduler stalled with unfinished requests"
        assert out.num_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        for request_, _ in out.scheduled:
            if request_.num_output_tokens:
                first_token_step.setdefault(request_.request_id, number)
    raise AssertionError("did not finish")


# -- plain records, as a run's files hold them --------------------------------------------------------------------

def request_record(request_id: str = "0", arrival: float = 0.0, *, token_times: Sequence[float] = (0.2, 0.3),
                   scheduled: float | None = None, **fields: Any) -> dict[str, Any]:
    """A ``RequestRecord`` of a request that arrived at ``arrival`` and produced a token at each of
    ``token_times`` (none: it failed, if ``error`` is given); ``fields`` override any other key."""
    token_times = list(token_times)
    error = fields.get("error")
    record = dict(
        request_id=request_id, client_id=None, priority=0, arrival_time=arrival,
        first_scheduled_time=(arrival + 0.1 if token_times else None) if scheduled is None else scheduled,
        first_token_time=token_times[0] if token_times else None,
        finish_time=token_times[-1] if token_times else (arrival if error else None),
        token_times=token_times, num_prompt_tokens=10, num_cached_tokens=0, num_output_tokens=len(token_times),
        num_preemptions=0, finish_reason=None if error or not token_times else "length", error=None,
    )
    record.update(fields)
    return record


def step_record(**fields: Any) -> dict[str, Any]:
    """A ``StepRecord`` of an empty one-second step at time 0 on a one-block cache; ``fields`` override."""
    record = dict(step=0, start_time=0.0, duration=1.0, num_prefill_tokens=0, num_decode_tokens=0,
                  num_prefill_seqs=0, num_decode_seqs=0, num_running=0, num_waiting=0, num_preempted=0,
                  kv_blocks_used=0, kv_blocks_cached=0, kv_blocks_free=0, kv_blocks_total=1, context_tokens=0,
                  attn_pairs=0, num_sampled=0)
    record.update(fields)
    return record


# -- model-free serving through runner=sim ------------------------------------------------------------------------

# The token_cost step-time model of each clock: (step_overhead, time_per_token).
CLOCKS = {"steps": (1.0, 0.0), "tokens": (16.0, 1.0)}


def workload_request(rid: str, prompt: Sequence[int], max_tokens: int, arrival: float = 0.0, *,
                     slo_ttft: float | None = None, slo_e2el: float | None = None, **fields: Any):
    """A ``WorkloadRequest`` (``ignore_eos``), its SLOs given in the clock's units (as ``Request`` holds them)."""
    from nanovllm.harness.workload import WorkloadRequest

    return WorkloadRequest(arrival_time=arrival, prompt=list(prompt), max_tokens=max_tokens, ignore_eos=True,
                           request_id=rid, ttft_slo_ms=None if slo_ttft is None else slo_ttft * 1000,
                           e2el_slo_ms=None if slo_e2el is None else slo_e2el * 1000, **fields)


def simulate(policy: Any, workload: Sequence[Any], *, allocator: Any = "paged", num_blocks: int = 256,
             block_size: int = 8, max_num_seqs: int = 4, max_num_batched_tokens: int = 2048,
             clock: str = "steps"):
    """Serve ``workload`` (arrival times on ``clock``) with ``policy`` through ``runner=sim`` on the token-cost
    clock; returns the run's ``RunResult`` (records, steps, summary)."""
    from nanovllm.config import EngineConfig
    from nanovllm.harness.sim import Simulation

    step_overhead, time_per_token = CLOCKS[clock]
    config = EngineConfig(num_kv_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    step_time = {"name": "token_cost", "step_overhead": step_overhead, "time_per_token": time_per_token}
    sim = Simulation.build(config, step_time, scheduler=policy, allocator=allocator)
    return sim.serve(workload)


def by_id(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A run's records keyed by request id."""
    return {r["request_id"]: r for r in records}


# -- small random-weight models -----------------------------------------------------------------------------------

# A 2-layer model with SmolLM2's vocabulary: a real architecture (tests/models/test_models.py) or many cheap engine
# steps (tests/engine/test_soak.py).
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152, tie_word_embeddings=False)


def save_tiny_model(config_cls, model_cls, extra: dict, path: Path, tokenizer_dir: Path, seed: int = 0):
    """Save a ``SMALL`` model of ``model_cls`` (weights scaled up so that logits are decisive and attention is not
    flat) with the tokenizer files of ``tokenizer_dir`` to ``path``; return the transformers model."""
    import torch

    torch.manual_seed(seed)
    config = config_cls(**SMALL, **extra, bos_token_id=1, eos_token_id=2)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # borrow the default model's tokenizer
        shutil.copy(Path(tokenizer_dir) / name, Path(path) / name)
    return model


def random_quant_linear(fmt: str, n: int, k: int, generator: Any, compiled: Any = None) -> Any:
    """A ``QuantLinear`` of ``n`` x ``k`` random weights in ``fmt`` (``int8``, ``q8_0`` or ``q4_1``), running on the
    kernel build ``compiled`` (None: the torch fallback). Codes, scales and mins are drawn from ``generator``."""
    import torch

    from nanovllm.models.quantized import QuantLinear

    if fmt == "int8":
        return QuantLinear.from_dense_int8(torch.randn(n, k, generator=generator), None, compiled)
    blocks = k // 32
    scales = (torch.rand(n, blocks, generator=generator) * 0.02 + 1e-3).half()
    if fmt == "q8_0":
        codes = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
        return QuantLinear(fmt, codes, scales, None, None, k, compiled)
    codes = torch.randint(0, 256, (n, k // 2), generator=generator, dtype=torch.uint8)
    mins = (torch.randn(n, blocks, generator=generator) * 0.02).half()
    return QuantLinear(fmt, codes, scales, mins, None, k, compiled)


# -- python -m nanovllm.run in a subprocess -----------------------------------------------------------------------

# A run of three tiny requests that finishes in seconds (the monitor's peaks are not measured).
TINY = [
    "workload=synthetic", "workload.num_requests=3", "workload.request_rate=inf",
    "workload.input_len.kind=fixed", "workload.input_len.mean=8",
    "workload.output_len.kind=fixed", "workload.output_len.mean=2",
    "engine.num_kv_blocks=64", "engine.max_model_len=512", "monitor.calibrate=false",
]


def cli_env(tmp_path: Path, pythonpath: str | os.PathLike = REPO, **extra: str) -> dict[str, str]:
    """The environment of a ``python -m nanovllm.run`` subprocess: no inherited Hydra or W&B settings, one OpenMP
    thread, W&B's files inside ``tmp_path``; ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    env.update(
        PYTHONPATH=str(pythonpath),
        # One OpenMP thread: on a small shared machine competing threads spin and slow every step tenfold.
        OMP_NUM_THREADS="1",
        # wandb's side files (settings, cache, staging) stay inside the test's directory.
        WANDB_DIR=str(tmp_path / "wandb_home"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_home" / "config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb_home" / "cache"), WANDB_DATA_DIR=str(tmp_path / "wandb_home" / "data"),
        WANDB_SILENT="true",
    )
    env.update(extra)
    return env


def run_cli(tmp_path: Path, *overrides: str, cwd: Path | None = None, timeout: int = 240,
            env: dict[str, str] | None = None, python: str = sys.executable) -> subprocess.CompletedProcess:
    """``python -m nanovllm.run OVERRIDES`` in ``cwd`` (default ``tmp_path``), its output captured."""
    return subprocess.run(
        [python, "-m", "nanovllm.run", *overrides], cwd=cwd or tmp_path, env=env or cli_env(tmp_path),
        capture_output=True, text=True, timeout=timeout,
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line a failed run must end with, and nothing else on stderr, no traceback anywhere."""
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    return lines[0]


HOLD_DIR = Path(__file__).with_name("startup_hold")


def held_env(tmp_path: Path, hold: str, **extra: str) -> dict[str, str]:
    """The subprocess parks at ``hold`` (see tests/startup_hold/sitecustomize.py) and writes ``held``."""
    return cli_env(tmp_path, pythonpath=os.pathsep.join([str(HOLD_DIR), str(REPO)]), NANOVLLM_TEST_HOLD=hold,
                   NANOVLLM_TEST_HOLD_MARKER=str(tmp_path / "held"), **extra)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds (a bound on waiting, never an assertion on time)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


def free_port() -> int:
    """A loopback port free right now (for a server subprocess a test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float = 240.0) -> None:
    """Wait for the server subprocess ``proc`` to answer ``GET {url}/health`` with 200; fail with its stderr if
    it exits first."""
    import httpx

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{proc.communicate()[1][-3000:]}")
        try:
            return client.get(f"{url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    # One client for every poll: ``httpx.get`` builds a client (an SSL context, the CA bundle read) per call,
    # ~30 ms of CPU, so polling every 20 ms took over half a core from the server starting beside it.
    with httpx.Client(timeout=5) as client:
        wait_for(healthy, f"the server at {url} answers /health", timeout=timeout)


def serve_with_live_loggers(served: Any, workload: Sequence[Any], run_dir: Path) -> Any:
    """Serve ``workload`` with the jsonl logger and ``live=web``'s loggers writing into ``run_dir`` (without
    starting the dashboard process: a test builds the Bokeh document from the files itself)."""
    from nanovllm.harness.live.config import LiveConfig
    from nanovllm.harness.live.launch import LiveSession
    from nanovllm.serving.loggers import JsonlLogger

    live = LiveSession(LiveConfig(mode="web"), run_dir)
    loggers = [JsonlLogger(), *live.attach(served.engine, len(workload))]
    for run_logger in loggers:
        run_logger.start(run_dir, {}, group=None, name="t")
    try:
        return served.serve(workload, loggers=loggers)
    finally:
        for run_logger in loggers:
            run_logger.finish()


def interrupt_server(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """Stop a server started in its own process group (``start_new_session=True``) as Ctrl-C would, and return
    its (stdout, stderr); a server that does not end within ``timeout`` is killed (the test then sees its
    return code)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def ray_processes() -> list[Any]:
    """The Ray daemons (raylet, gcs_server) of this test process's Ray temp dir (``RAY_TMPDIR``, one per xdist
    worker: ``conftest.py``), started by it or by a subprocess it ran: a Ray instance another worker, or another
    checkout's tests on a shared machine, started is not counted."""
    import psutil

    own = os.environ.get("RAY_TMPDIR") or "/tmp/ray"
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            text = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        except psutil.Error:
            continue
        if ("raylet" in text or "gcs_server" in text) and own in text:
            found.append(proc)
    return found


def expected_fed_tokens(prompt_len: int, steps: list[dict]) -> list[int]:
    """Per step of a one-request run, what a draft model feeds (``DraftModel.propose``): the request's tokens its
    cache lacks (its whole context the first time; the newest token always), then its own proposals but the last;
    after a verification its cache keeps what it fed up to the first rejected proposal. The rule the simulator's
    stand-in counts by (``SimulatedProposer._feed``)."""
    tokens, drafted_through, fed = prompt_len, 0, []
    for step in steps:
        k = step["spec_decode_num_draft_tokens"]
        if step["num_prefill_tokens"]:
            fed.append(0)
            tokens += step["num_sampled"]
            continue
        fed.append(tokens - min(tokens - 1, drafted_through) + k - 1 if k else 0)
        drafted_through = tokens + k - 1 if k else drafted_through
        tokens += step["spec_decode_num_accepted_tokens"] + 1
    return fed

"""The peak and step time of a training step compiled with inductor: torch.compile's own ``activation_memory_budget``
points beside ``fxplan.auto_checkpoint(..., compile_backend="inductor")`` at several budgets, side by side in one run.

A GPT-2 from its config class (random weights, dropout off, ``use_cache=False``), one batch of token ids. Every
method is compiled afresh (``torch._dynamo.reset()``: inductor's caches would run one method's code for the next)
and run once to compile; its peak is read from torch.profiler's allocation events on the next step
(:func:`fxplan.measure.meter.profiled_step_peak`, which sees compiled kernels' buffers). Times: in each round,
every method in rotating order is compiled again and ``--steps`` steps after it are timed
(:func:`fxplan.measure.timing.time_interleaved`), medians and spreads over the rounds. Peaks are shares of the
eager unplanned step's (profiler); times are ratios to the compiled unplanned step, per round. A row is dominated
where another has a peak and a time no larger, one of them smaller. Run:

    python scripts/compile_front.py [--layers 4] [--width 256] [--batch-size 16] [--seq 128] [--rounds 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch._functorch.config as functorch_config
import transformers

import fxplan
from fxplan.measure.meter import profiled_step_peak
from fxplan.measure.timing import time_interleaved


def _loss(output):
    return output.loss


def _compiled(model, batch, compile_config: dict):
    """``model`` compiled with inductor afresh under ``compile_config``, after one step that compiles it.

    Compiled code is kept per process, and the code compiled for one copy of the model would run for the next
    (inductor's caches do not tell compile's budgets apart): each method is compiled after ``torch._dynamo.reset()``.
    """
    torch._dynamo.reset()
    with functorch_config.patch(**compile_config):
        compiled = torch.compile(model, backend="inductor")
        _loss(compiled(**batch)).backward()
    model.zero_grad(set_to_none=True)
    return compiled


def _peak(model, batch, compile_config: dict) -> int:
    compiled = _compiled(model, batch, compile_config)
    peak = profiled_step_peak(compiled, batch, _loss)
    model.zero_grad(set_to_none=True)
    return peak


def _timed(model, batch, compile_config: dict, steps: int):
    """A function that compiles ``model`` afresh and returns the mean seconds of ``steps`` steps after it."""
    def run() -> float:
        compiled = _compiled(model, batch, compile_config)
        start = time.perf_counter()
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            _loss(compiled(**batch)).backward()
        return (time.perf_counter() - start) / steps
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps timed after each compile")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=1000,
                                     n_positions=args.seq, use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0,
                                     embd_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (args.batch_size, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    eager = profiled_step_peak(model, batch, _loss)
    model.zero_grad(set_to_none=True)
    print(f"GPT-2 {args.layers}x{args.width}, batch {args.batch_size}x{args.seq}, torch {torch.__version__}, "
          f"inductor, one thread; eager unplanned peak {eager / 2**20:.1f} MiB (profiler)")

    planned_models = {}  # planned first: planning for compiled steps resets dynamo's caches
    for share in (0.8, 0.6, 0.5, None):
        planned = copy.deepcopy(model)
        try:
            fxplan.auto_checkpoint(planned, example_inputs=batch, loss_fn=_loss, compile_backend="inductor",
                                   budget_bytes=share and int(share * eager))
        except fxplan.BudgetError as error:
            print(f"auto_checkpoint for {share} of the eager peak: refused ({error.fact})")
            continue
        label = "smallest" if share is None else share
        planned_models[f"auto_checkpoint (compile_backend='inductor', {label})"] = planned
    methods: dict[str, tuple] = {}  # name -> (model, compile config)
    for amb in (1.0, 0.8, 0.5, 0.3, 0.1):
        name = "compile, unplanned" if amb == 1.0 else f"compile, activation_memory_budget={amb}"
        methods[name] = (model, {} if amb == 1.0 else {"activation_memory_budget": amb})
    methods.update({name: (planned, {}) for name, planned in planned_models.items()})
    peaks = {name: _peak(m, batch, config) for name, (m, config) in methods.items()}
    timings = time_interleaved({name: _timed(m, batch, config, args.steps) for name, (m, config) in methods.items()},
                               baseline="compile, unplanned", rounds=args.rounds, warmup=0)
    rows = [(name, peaks[name] / eager, timings[name].ratio, timings[name].median, timings[name].spread)
            for name in methods]
    print("| method | compiled peak (share of eager unplanned) | step time (ratio to compiled unplanned) | "
          "median s | spread | dominated by |")
    print("|---|---|---|---|---|---|")
    for name, peak, ratio, median, spread in rows:
        over = [other for other, p, r, _, _ in rows if other != name and p <= peak and r <= ratio
                and (p < peak or r < ratio)]
        print(f"| {name} | {peak:.3f} | {ratio:.3f} | {median:.3f} | {spread:.2f} | {', '.join(over) or '-'} |")


if __name__ == "__main__":
    main()

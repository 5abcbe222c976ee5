"""Peak memory and step time of one BPTT training step of models_zoo's lstm_lm, several ways.

    python scripts/bptt_lstm_benchmark.py [--seq 512] [--batch 20] [--slots 4 16 64 256]

Rows: plain BPTT through ``nn.LSTM`` (the model's own forward), plain BPTT through the unrolled per-step
core (one autograd graph for the whole sequence), the two-chunk scheme of the PyTorch forum post
(forward the first half without autograd, back-propagate the second half, then recompute and
back-propagate the first half), and ``fxplan.bptt.backward`` with policy MSM at several slot counts
(hidden-state units; one internal state costs alpha units, measured). Synthetic tokens, dropout 0.5 in
train mode. Peak memory is ``fxplan.measure.meter.track_memory`` (live tensor storages on the CPU, parameters
and tokens included), time is a second, untracked run. Gradients of every row are checked against the
unrolled plain row (same dropout masks: every row seeds the RNG the same way per time step).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import fxplan.bptt as bptt
import models_zoo
from fxplan.measure.tracker import track_memory
from models_zoo.entry import synthetic_targets

MiB = 1024**2


@contextlib.contextmanager
def seeded(value: int):
    """Run under ``torch.manual_seed(value)`` and restore the RNG: dropout masks fixed per time step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(value)
        yield


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--slots", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = models_zoo.get("lstm_lm").build()
    model.train()
    core = model.core()
    T, B, V = args.seq, args.batch, model.vocab_size
    tokens = torch.randint(0, V, (T, B))
    # Targets of lm_loss for the whole sequence, laid out (seq, batch); per step the same ones.
    targets = synthetic_targets(torch.empty(()).expand(T, V, B), class_dim=1)
    seed = 1234
    params = list(model.parameters())

    def step_loss(y, t):  # decoder + cross-entropy of step t, scaled so that the sum is lm_loss
        with seeded(seed + 10**6 + t):
            logits = model.decoder(model.drop(y))
        return torch.nn.functional.cross_entropy(logits, targets[t], reduction="sum") / (T * B)

    def embed():
        with seeded(seed + 2 * 10**6):
            return model.drop(model.encoder(tokens))

    def plain_lstm():
        # The model's own forward; its dropout masks differ from the per-step rows (not compared).
        logits, _ = model(tokens)
        loss = models_zoo.lm_loss(logits)
        loss.backward()
        return loss.detach()

    def core_step(x, h, t):
        with seeded(seed + t + 1):  # what fxplan.bptt.backward(preserve_rng_state=seed) does for step t
            return core(x, h)

    def plain_unrolled():
        emb = embed()
        h, total = core.init_hidden(B, like=emb), 0
        for t in range(T):
            y, h = core_step(emb[t], h, t)
            total = total + step_loss(y, t)
        total.backward()
        return total.detach()

    def two_chunk():
        # Forum post: hidden state at the middle kept from a no-grad pass, each half back-propagated alone.
        emb = embed()
        x = emb.detach().requires_grad_()
        half = T // 2
        h = core.init_hidden(B, like=emb)
        with torch.no_grad():
            hm = h
            for t in range(half):
                _, hm = core_step(x[t], hm, t)
        hm = tuple(v.detach().requires_grad_() for v in hm)
        total, hh = 0, hm
        for t in range(half, T):
            y, hh = core_step(x[t], hh, t)
            total = total + step_loss(y, t)
        total.backward()
        carry = [v.grad for v in hm]
        del hh, total
        total2, hh = 0, h
        for t in range(half):
            y, hh = core_step(x[t], hh, t)
            total2 = total2 + step_loss(y, t)
        torch.autograd.backward([total2, *hh], [torch.ones(()), *carry])
        emb.backward(x.grad)
        return None

    def fxplan_run(slots):
        def run():
            emb = embed()
            stats = bptt.BackwardStats()
            bptt.backward(core, emb, core.init_hidden(B, like=emb), step_loss, slots=slots, policy="msm",
                          preserve_rng_state=seed, stats=stats)
            run.stats = stats

        return run

    methods = [("plain BPTT, nn.LSTM", plain_lstm), ("plain BPTT, unrolled core", plain_unrolled),
               ("two chunks (forum post)", two_chunk)]
    methods += [(f"fxplan.bptt msm, {s} slots", fxplan_run(s)) for s in args.slots]

    rows, ref = [], None
    for name, fn in methods:
        for p in params:
            p.grad = None
        with track_memory(tokens, *params) as tr:
            fn()
        peak = tr.peak_bytes
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        tic = time.perf_counter()
        fn()
        sec = time.perf_counter() - tic
        if name.startswith("plain BPTT, unrolled"):
            ref = grads
        err = "" if ref is None or name.endswith("nn.LSTM") else \
            f"{max(float((a - b).abs().max()) for a, b in zip(grads, ref)):.1e}"
        st = getattr(fn, "stats", None)
        extra = f"alpha={st.alpha} beta={st.beta}, {st.forward_calls} core calls" if st else ""
        rows.append((name, peak, sec, err, extra))
        print(f"{name:<30} {peak / MiB:9.1f} MiB {sec:8.2f} s  {err:>8}  {extra}", flush=True)

    base_mem, base_t = rows[1][1], rows[1][2]
    print(f"\nlstm_lm, seq {T}, batch {B}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| method | peak memory (MiB) | vs unrolled plain | step time (s) | vs unrolled plain "
          "| max grad diff | notes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, peak, sec, err, extra in rows:
        print(f"| {name} | {peak / MiB:.1f} | {peak / base_mem:.2f}x | {sec:.2f} | {sec / base_t:.2f}x "
              f"| {err or '-'} | {extra} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A 2-layer LSTM word-language model and its per-time-step recurrent core, for fxplan's BPTT planner.

The model mirrors the "medium" configuration of PyTorch's word_language_model example (vocabulary 10,000,
embedding and hidden size 650, 2 layers, dropout 0.5): embedding, dropout, ``nn.LSTM``, dropout, linear
decoder. Gruslys et al. (2016) plan memory for back-propagation through time over such a recurrent core;
:class:`LSTMCore` exposes that core one time step at a time so that ``fxplan.bptt`` can unroll it.

Conventions:

* inputs are token ids of shape ``(seq_len, batch)`` (time-major, like the example);
* ``LSTMLanguageModel.forward(tokens)`` returns ``(logits, (h_n, c_n))`` with logits of shape
  ``(seq_len, batch, vocab)`` and ``h_n, c_n`` of shape ``(layers, batch, hidden)``, starting from zeros;
  ``forward_from(tokens, (h_0, c_0))`` starts from a given state;
* the core's hidden state is a *flat* tuple ``(h_0, c_0, h_1, c_1, ...)`` of ``(batch, hidden)`` tensors,
  one ``(h, c)`` pair per layer.

The core's ``nn.LSTMCell`` layers hold the *same* ``nn.Parameter`` objects as the model's ``nn.LSTM``
(both use the gate order i, f, g, o), so gradients computed through an unrolled core land in the model's
parameters. Running :meth:`LSTMLanguageModel.forward_unrolled` in eval mode gives the same logits as
:meth:`LSTMLanguageModel.forward` (up to float rounding); in train mode the dropout masks differ in value
but not in distribution.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models_zoo.entry import synthetic_cross_entropy

#: Vocabulary size of the "medium" word_language_model configuration (Penn Treebank, 10k words).
VOCAB_SIZE = 10_000


class LSTMCore(nn.Module):
    """One time step of a multi-layer LSTM: ``forward(x_t, h) -> (y_t, h_next)``.

    ``x_t`` is ``(batch, input_size)``; ``h`` is the flat tuple ``(h_0, c_0, ..., h_{L-1}, c_{L-1})``;
    ``y_t`` is the top layer's ``h`` (``(batch, hidden)``). Between layers, dropout with probability
    ``dropout`` is applied in train mode, as ``nn.LSTM(dropout=...)`` does.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.cells = nn.ModuleList(
            nn.LSTMCell(input_size if i == 0 else hidden_size, hidden_size) for i in range(num_layers)
        )
        self.drop = nn.Dropout(dropout)

    @classmethod
    def sharing(cls, lstm: nn.LSTM) -> LSTMCore:
        """A core whose cells share (not copy) the parameters of ``lstm`` (unidirectional, with biases)."""
        if lstm.bidirectional or not lstm.bias or lstm.proj_size or lstm.batch_first:
            raise ValueError("LSTMCore.sharing supports unidirectional, time-major nn.LSTM with biases only")
        core = cls(lstm.input_size, lstm.hidden_size, lstm.num_layers, lstm.dropout)
        for i, cell in enumerate(core.cells):
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                setattr(cell, name, getattr(lstm, f"{name}_l{i}"))
        return core

    def init_hidden(self, batch_size: int, *, like: Tensor | None = None) -> tuple[Tensor, ...]:
        """Zero state for ``batch_size`` sequences, with the dtype and device of ``like`` if given."""
        kw = {} if like is None else {"dtype": like.dtype, "device": like.device}
        return tuple(torch.zeros(batch_size, self.hidden_size, **kw) for _ in range(2 * self.num_layers))

    def forward(self, x_t: Tensor, h: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        nxt: list[Tensor] = []
        inp = x_t
        for i, cell in enumerate(self.cells):
            if i > 0:
                inp = self.drop(inp)
            hi, ci = cell(inp, (h[2 * i], h[2 * i + 1]))
            nxt += [hi, ci]
            inp = hi
        return inp, tuple(nxt)


class LSTMLanguageModel(nn.Module):
    """Embedding, dropout, multi-layer ``nn.LSTM``, dropout, linear decoder (see the module docstring)."""

    def __init__(
        self, vocab_size: int = VOCAB_SIZE, emb_size: int = 650, hidden_size: int = 650, num_layers: int = 2,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.encoder = nn.Embedding(vocab_size, emb_size)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.LSTM(emb_size, hidden_size, num_layers, dropout=dropout)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        # Uniform(-0.1, 0.1) encoder/decoder weights and a zero decoder bias, like the PyTorch example.
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Logits and final ``(h_n, c_n)`` for ``tokens`` starting from a zero state.

        Takes one argument so that torch.fx traces it with a single placeholder; use :meth:`forward_from`
        to carry a state across batches (truncated BPTT).
        """
        return self.forward_from(tokens, None)

    def forward_from(
        self, tokens: Tensor, hidden: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Like :meth:`forward`, from the state ``hidden = (h_0, c_0)`` (``None`` means zeros)."""
        emb = self.drop(self.encoder(tokens))
        output, hidden = self.rnn(emb, hidden)
        return self.decoder(self.drop(output)), hidden

    def core(self) -> LSTMCore:
        """The per-time-step recurrent core, sharing this model's LSTM parameters and train/eval mode."""
        core = LSTMCore.sharing(self.rnn)
        core.train(self.training)
        return core

    def forward_unrolled(self, tokens: Tensor) -> Tensor:
        """Reference forward that runs :meth:`core` one step at a time from a zero state; returns logits."""
        core = self.core()
        emb = self.drop(self.encoder(tokens))
        h = core.init_hidden(tokens.shape[1], like=emb)
        ys = []
        for t in range(tokens.shape[0]):
            y, h = core(emb[t], h)
            ys.append(y)
        return self.decoder(self.drop(torch.stack(ys)))


def lm_loss(output: tuple[Tensor, tuple[Tensor, Tensor]] | Tensor) -> Tensor:
    """Cross-entropy of the logits against deterministic synthetic targets; the hidden state is ignored.

    Targets come from :func:`models_zoo.entry.synthetic_targets` (no RNG is consumed), so a recomputing
    executor and a plain step see identical targets.
    """
    logits = output[0] if isinstance(output, tuple) else output
    return synthetic_cross_entropy(logits, class_dim=-1)

"""int8 linear layers whose rows do not depend on each other: a batch-invariant int8 draft.

`torch.ao` dynamic quantisation quantises each call's input with one scale and zero point taken
over the whole input, so a row's int8 values, and its output, depended on the other rows of the
call: a seeded request's draft (and so its tokens) depended on the requests it was batched with
(`benchmarks/investigations/batch_invariance/batch_invariance.py`: 0/16 equal), and a row far
smaller than its batch mates was crushed to a few levels. Here every row is divided by its own
absolute maximum first, and one sentinel row [1, -1, 0, ...] is appended, so the range the
dynamic quantiser sees is exactly [-1, 1] in every call: each row is quantised on its own scale,
the int8 product sums exactly (int32), and the row's output is scaled back by its maximum. A
row's output is then a function of that row alone, and the fast kernel stays oneDNN's
(AMX-INT8). `torch._int_mm` would do the same without the trick, at 2 to 3 times the cost on
these CPUs.

Weights are int8 per output channel, as before. The decode's exactness never depends on the
draft (verification uses the draft's actual q); only its acceptance rate does.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

_TINY = 1e-12  # the scale of an all-zero row (its values are 0 whatever it is)


class RowScaledInt8Linear(nn.Module):
    """`nn.Linear` with int8 weights (per output channel) and int8 activations (per row)."""

    sentinel: torch.Tensor  # a registered buffer

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        with warnings.catch_warnings():  # torch warns that quantized tensor creation is deprecated
            warnings.simplefilter("ignore", UserWarning)
            from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
            from torch.ao.quantization import per_channel_dynamic_qconfig

            plain = nn.Linear(linear.in_features, linear.out_features, bias=False)
            plain.weight = nn.Parameter(linear.weight.detach().to(torch.float32))
            plain.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]  # torch's dynamic quantisation reads qconfig
            self.quantized = DynamicLinear.from_float(plain)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = linear.bias.detach().to(torch.float32).clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        sentinel = torch.zeros(1, linear.in_features)
        sentinel[0, 0], sentinel[0, -1] = 1.0, -1.0  # the quantiser's range: exactly [-1, 1]
        self.register_buffer("sentinel", sentinel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32)
        scale = flat.abs().amax(dim=1, keepdim=True).clamp_min(_TINY)
        rows = torch.cat([flat / scale, self.sentinel.to(flat.device)])
        out = self.quantized(rows)[:-1].mul_(scale)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, per-row int8"


def quantize_linears(model: nn.Module) -> int:
    """Replace every plain `nn.Linear` of the model by a `RowScaledInt8Linear` (in place);
    returns how many."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, RowScaledInt8Linear(child))
                replaced += 1
    return replaced

"""The wire format of cross-rank handoffs (``exchange`` between calls, ``stream`` inside them).

A block of named values is two messages: int64 [2] (header bytes, payload bytes), then uint8
[header + payload]; the header is the JSON list of (module qualified name, call kind, call n,
field, dtype, shape) of each value, the payload the values' bytes in that order. Call names travel
as qualified names: every rank runs the same model. The receiver reads the header on the host (a
small device-to-host copy). Gradients travel without a header: their sender's peer knows their
dtypes and shapes (those of the values it sent).
"""

from __future__ import annotations

import json

import torch

__all__ = ["Name", "as_bytes", "decode", "encode", "from_bytes"]

Name = tuple[str, str, int, str]  # (module qualified name, call kind, call n, field)


def as_bytes(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The values' bytes, concatenated (uint8 [sum of their sizes])."""
    flat = [v.contiguous().view(-1).view(torch.uint8) for v in values]
    return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8, device=device)


def from_bytes(buffer: torch.Tensor, specs: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
    """:func:`as_bytes`' inverse, given each value's (dtype, shape)."""
    out, at = [], 0
    for dtype, shape in specs:
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append(buffer[at : at + n].clone().view(dtype).view(shape))  # clone: an aligned copy
        at += n
    return out


def encode(values: list[tuple[Name, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sizes int64 [2], message uint8 [header + payload]) of named values (module docstring)."""
    header = [[*name, str(v.dtype), list(v.shape)] for name, v in values]
    head = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8, device=device)
    payload = as_bytes([v for _, v in values], device)
    sizes = torch.tensor([head.numel(), payload.numel()], dtype=torch.int64, device=device)
    return sizes, torch.cat((head, payload))


def decode(sizes: torch.Tensor, message: torch.Tensor) -> list[tuple[Name, torch.Tensor]]:
    """:func:`encode`'s inverse."""
    header_bytes = int(sizes[0])
    header = json.loads(bytes(message[:header_bytes].cpu().tolist()).decode())
    specs = [(getattr(torch, dtype.removeprefix("torch.")), shape) for *_, dtype, shape in header]
    values = from_bytes(message[header_bytes:], specs)
    return [((name, kind, n, field), v) for (name, kind, n, field, _, _), v in zip(header, values)]

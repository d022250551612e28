"""The wire format of cross-rank handoffs (``exchange`` between calls, ``stream`` inside them).

A block of named values is two messages: int64 [2] (header bytes, payload bytes), then uint8
[header + payload]; the header is the JSON list of (module qualified name, call kind, call n,
field, dtype, shape) of each value, the payload the values' bytes in that order. Call names travel
as qualified names: every rank runs the same model. The receiver reads the header on the host (a
small device-to-host copy). A streamed value (``stream``) sends its header on a host group instead
(no device copy), its payload on its own. Gradients travel without a header: their sender's peer
knows their dtypes and shapes (those of the values it sent).
"""

from __future__ import annotations

import json

import torch

__all__ = ["Name", "as_bytes", "decode", "encode", "from_bytes", "header", "read_header"]

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


def header(values: list[tuple[Name, torch.Tensor]]) -> torch.Tensor:
    """uint8 [h] on the host: the header of named values (their names, dtypes and shapes are host
    metadata: building it reads nothing from the device)."""
    entries = [[*name, str(v.dtype), list(v.shape)] for name, v in values]
    return torch.tensor(list(json.dumps(entries).encode()), dtype=torch.uint8)


def read_header(head: torch.Tensor) -> list[tuple[Name, torch.dtype, list[int]]]:
    """:func:`header`'s inverse: (name, dtype, shape) of each value."""
    entries = json.loads(bytes(head.cpu().tolist()).decode())
    return [
        ((name, kind, n, field), getattr(torch, dtype.removeprefix("torch.")), shape)
        for name, kind, n, field, dtype, shape in entries
    ]


def encode(values: list[tuple[Name, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sizes int64 [2], message uint8 [header + payload]) of named values (module docstring)."""
    head = header(values).to(device)
    payload = as_bytes([v for _, v in values], device)
    sizes = torch.tensor([head.numel(), payload.numel()], dtype=torch.int64, device=device)
    return sizes, torch.cat((head, payload))


def decode(sizes: torch.Tensor, message: torch.Tensor) -> list[tuple[Name, torch.Tensor]]:
    """:func:`encode`'s inverse."""
    header_bytes = int(sizes[0])
    entries = read_header(message[:header_bytes])
    values = from_bytes(message[header_bytes:], [(dtype, shape) for _, dtype, shape in entries])
    return [(name, v) for (name, _, _), v in zip(entries, values)]

"""Graphs in host memory (``harts_hf.engine.offload``): a forward inside ``HostGraphs.saving`` saves
copies of its tensors, so its backward reads what the forward saw, fetched or not; parameters and
tensors under ``MIN_BYTES`` stay where they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harts_hf.engine.offload import MIN_BYTES, HostGraphs


@pytest.mark.parametrize("fetched", [True, False])
def test_the_backward_reads_the_copies_made_in_the_forward(fetched):
    """The saved activations are copies: changed in place after the forward (which autograd
    refuses without them), the backward still reads the forward's values. Only they moved, not the
    parameter nor the small tensor the forward saved."""
    torch.manual_seed(0)
    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    weight = nn.Parameter(torch.randn(16, 16))
    small = torch.randn(4, requires_grad=True)
    graphs = HostGraphs(torch.device("cpu"))
    with graphs.saving() as call:
        h = x @ w  # saves x and w
        y = (h @ weight).tanh().sum() + (small * small).sum()  # saves h, weight, the tanh output, small
    expected = torch.autograd.grad(((x @ w) @ weight).tanh().sum() + (small * small).sum(), (x, w, weight, small))
    saved = [x, w, h, torch.tanh(h @ weight)]
    assert graphs.moved == sum(t.numel() * t.element_size() for t in saved)
    assert small.numel() * small.element_size() < MIN_BYTES
    with torch.no_grad():
        x.mul_(0)  # the graph's saved x is a copy: the backward does not see this
        w.mul_(0)
    if fetched:
        call.fetch()
    y.backward()
    for leaf, grad in zip((x, w, weight, small), expected):
        torch.testing.assert_close(leaf.grad, grad, rtol=0, atol=0)

"""take_rows: index_select with a contiguous-add backward; its values and gradients equal index_select's."""

import torch

from harts_hf.ops.take_rows import take_rows


def test_take_rows_equals_index_select_with_repeats_and_a_transposed_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 5, 4, generator=gen).transpose(1, 2)  # a non-contiguous source, as the driver gathers
    index = torch.tensor([6, 0, 0, 3, 6, 6, 1])  # repeats; rows 2, 4, 5 never taken
    weight = torch.randn(index.numel(), 5, 4, 3, generator=gen).transpose(-1, -2)  # makes the gradient transposed
    grads = []
    for gather in (lambda t: t.index_select(0, index), lambda t: take_rows(t, index)):
        leaf = x.detach().clone().requires_grad_()
        out = gather(leaf)
        (out * weight).sum().backward()
        grads.append((out.detach(), leaf.grad))
    (want, want_grad), (got, got_grad) = grads
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-6)
    assert not got_grad[[2, 4, 5]].any()


def test_take_rows_without_grad_is_a_plain_gather() -> None:
    x = torch.arange(12.0).view(4, 3)
    out = take_rows(x, torch.tensor([3, 3, 0]))
    assert out.grad_fn is None
    torch.testing.assert_close(out, x[[3, 3, 0]])
    with torch.no_grad():
        assert take_rows(x.requires_grad_(), torch.tensor([1])).grad_fn is None

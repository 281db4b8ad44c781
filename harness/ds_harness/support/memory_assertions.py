"""Compare the gradient memory an accumulation holds in unmanaged and managed mode (measured per backward)."""

from __future__ import annotations


def assert_same_gradient_memory(managed: list, unmanaged: list, bucket_bytes: int) -> None:
    """Per rank: the bytes held after a backward are the same in both modes, up to one reduce bucket.

    Measured (ds_harness.support.scenarios): a reduce-bucket buffer whose asynchronous reduction is still
    being released sometimes counts after a backward, in either mode and at random (it depends on the
    communication thread's timing), never more than one. So the floor over the backward passes must be
    equal and the worst case may exceed managed mode's by one bucket at most.
    """
    for rank, (m, u) in enumerate(zip(managed, unmanaged)):
        assert abs(min(u) - min(m)) <= 64, f"rank {rank}: managed {m}, unmanaged {u}"
        assert max(u) <= max(m) + bucket_bytes, f"rank {rank}: managed {m}, unmanaged {u}"

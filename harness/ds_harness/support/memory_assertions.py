"""Compare the gradient memory an accumulation holds in unmanaged and managed mode (measured per backward)."""

from __future__ import annotations


def assert_same_gradient_memory(managed: list, unmanaged: list, in_flight_bytes: int) -> None:
    """Per rank: the bytes held after a backward are the same in both modes, up to one reduction in flight.

    Measured (ds_harness.support.scenarios): the tensor of a reduction still being released sometimes counts
    after a backward, in either mode and at random (it depends on the communication's timing), never more than
    one: a reduce bucket, or the gradient of a parameter larger than the bucket, which ZeRO reduces on its own.
    So the floor over the backward passes must be equal and the worst case may exceed managed mode's by
    ``in_flight_bytes`` (the larger of the two) at most.
    """
    for rank, (m, u) in enumerate(zip(managed, unmanaged)):
        assert abs(min(u) - min(m)) <= 64, f"rank {rank}: managed {m}, unmanaged {u}"
        assert max(u) <= max(m) + in_flight_bytes, f"rank {rank}: managed {m}, unmanaged {u}"

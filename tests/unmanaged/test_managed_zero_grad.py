"""A direct ``engine.optimizer.zero_grad()`` between managed micro-batches discards the micro-batch on ZeRO-2 as on
ZeRO-1, in 0.19.3 as with the series: PR zero-2 leaves the optimizer's ``zero_grad()`` as it is and gives unmanaged
``engine.zero_grad()`` its own ``discard_gradient_accumulation()`` (the default-behaviour check's
``zero2-optimizer-zero-grad-between`` case compares it bitwise with DeepSpeed without the series).
"""

import pytest

from ds_harness.support.paths import PATHS

pytestmark = pytest.mark.pr("zero-2")


def _discarded_micro_batch_stays_discarded(path_name: str, reference_name: str) -> None:
    from ds_harness.support.training import assert_params_close, destroy, forward_loss, snapshot

    results = []
    for name in (path_name, reference_name):
        engine = PATHS[name].initialize(gas=2, managed=None)
        for step in range(2):
            engine.backward(forward_loss(engine, step, 0))
            engine.step()
            engine.optimizer.zero_grad()  # discard micro-batch 0
            engine.backward(forward_loss(engine, step, 1))
            engine.step()
        results.append(snapshot(engine))
        destroy(engine)
    actual, expected = results
    assert_params_close(actual.params, expected.params, f"{path_name} vs {reference_name}", rtol=1e-5, atol=1e-7)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero2-fp32", "zero2-overlap-comm"])
def test_zero_grad_between_micro_batches_discards_like_zero1(dist, path_name):
    dist.run(_discarded_micro_batch_stays_discarded, path_name, "zero1-fp32")

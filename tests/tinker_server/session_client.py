"""A tinker SDK client the session tests drop: ``python session_client.py BASE_URL API_KEY N RANK``.

It opens N LoRA training clients in one ServiceClient, takes one step on each (so every engine holds gradients and
Adam state) and an unnamed sampler snapshot of each (held in the ranks' sampler pools), prints ``READY <model ids as
JSON>`` and waits for a line on stdin. The test freezes it meanwhile (SIGSTOP: no heartbeats, as a hung or crashed
client) until the server closes its session; then it is let go and tries one more step on each client, printing
``RAISED <exception type>: <message>`` (or ``OK``) per client.
"""

from __future__ import annotations

import json
import sys

import tinker
from tinker import types


def main() -> None:
    base_url, api_key, count, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 33))),
                        loss_fn_inputs={"target_tokens": list(range(2, 34))})]
    clients = [service.create_lora_training_client("small-llama-byte", rank=rank).result() for _ in range(count)]
    for client in clients:
        client.forward_backward(data, "cross_entropy").result(timeout=300)
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)
        client.save_weights_and_get_sampling_client().result(timeout=300)
    print("READY", json.dumps([client.model_id for client in clients]), flush=True)
    sys.stdin.readline()
    for client in clients:
        try:
            client.forward_backward(data, "cross_entropy").result(timeout=120)
            print("OK", flush=True)
        except Exception as e:
            print("RAISED", f"{type(e).__name__}: {e}".replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()

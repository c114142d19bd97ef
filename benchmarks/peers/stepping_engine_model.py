"""A decoupled Triton Python-backend model shaped like Triton's vLLM backend: ``execute``
hands each request to the model's own engine thread and returns at once; the engine steps
every active request together, one token each per step, and each step costs ``STEP_S``
whatever the number of requests (as a GPU decode step nearly does). A server that lets
the instance take its next batch when ``execute`` returns gets one token per step for
every stream open; one that waits for the FINAL flags gets one token per step in all.

The same file is ``model.py`` on kiln and on Triton in ``decoupled_streams.py``.
Input ``MAX_TOKENS`` (INT32 [1]); output ``TOKEN`` (INT32 [1]): 0, 1, 2, ...
"""

import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

STEP_S = 0.004


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.running = True
        self.engine = threading.Thread(target=self.run, daemon=True)
        self.engine.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "MAX_TOKENS").as_numpy()
            self.inbox.put([request.get_response_sender(), int(tokens.reshape(-1)[0]), 0])
        return None

    def run(self) -> None:
        active: list = []
        while self.running:
            if not active:
                try:
                    active.append(self.inbox.get(timeout=0.1))
                except queue.Empty:
                    continue
            while True:  # everything that arrived joins this step
                try:
                    active.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            time.sleep(STEP_S)
            still = []
            for entry in active:
                sender, budget, made = entry
                last = made + 1 >= budget or sender.is_cancelled()
                token = pb_utils.Tensor("TOKEN", np.array([made], np.int32))
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
                sender.send(pb_utils.InferenceResponse(output_tensors=[token]), flags=flags)
                entry[2] = made + 1
                if not last:
                    still.append(entry)
            active = still

    def finalize(self) -> None:
        self.running = False
        self.engine.join(timeout=5)

"""Test model with the public `spec_decode` interface and a fake engine, for client tests.

Tokens are UTF-8 bytes (vocabulary 256). Greedy decoding continues a prompt with lowercase letters,
`next = a + (7 * prev + 3) % 26`; at temperature > 0 it draws letters from a generator seeded by
`seed`. Prefill emits one token; step `s >= 1` drafts `k` tokens (fewer near `max_tokens`),
"accepts" `s % (k + 1)` of them and emits those plus one. Each request runs in its own thread and
holds one slot, counted by the gauge `spec_decode_live_sequences`, until it finishes or the client
cancels it; `spec_decode_finished_requests{reason}` counts finished requests, as the engine does.
Beyond `max_slots` live requests, a request is refused as UNAVAILABLE ("slots are busy").
Calls into the backend (send, is_cancelled, metrics, tensors) take one lock: concurrent ones crashed
server 2.51.
"""
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

VOCAB = 256
DEFAULT_DRAFT_TOKENS = 2
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class InvalidRequest(ValueError):
    """Bad input: answered with an INVALID_ARG error naming the tensor."""


def optional(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy()


def scalar(request, name, default):
    value = optional(request, name, None)
    if value is None:
        return default
    if value.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got {value.size}")
    return value.reshape(-1)[0]


def prompt_ids(request):
    text = optional(request, "text_input", None)
    ids = optional(request, "input_ids", None)
    if (text is None) == (ids is None):
        raise InvalidRequest("exactly one of text_input or input_ids is required")
    if text is not None:
        ids = np.frombuffer(text.reshape(-1)[0], dtype=np.uint8).astype(np.int32)  # [T]
    ids = ids.reshape(-1).astype(np.int32)  # [T]
    if ids.size == 0:
        raise InvalidRequest("the prompt is empty")
    if ids.min() < 0 or ids.max() >= VOCAB:
        raise InvalidRequest(f"input_ids must lie in [0, {VOCAB})")
    return ids


def decode(ids):
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.step_delay = float(params["step_delay_s"])
        self.max_draft = int(params["max_draft_tokens"])
        self.max_slots = int(params["max_slots"])
        self.busy = 0
        self.live_family = pb_utils.MetricFamily(
            name="spec_decode_live_sequences",
            description="sequences holding a slot",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.live = self.live_family.Metric(labels={})
        self.finished_family = pb_utils.MetricFamily(
            name="spec_decode_finished_requests",
            description="requests finished, by finish_reason",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.finished = {r: self.finished_family.Metric(labels={"reason": r}) for r in ("length", "stop", "cancelled")}
        self.threads = []
        self.backend = threading.Lock()

    def execute(self, requests):
        with self.backend:
            self.start(requests)
        return None

    def start(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self.parse(request)
            except InvalidRequest as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            if self.busy == self.max_slots:
                error = pb_utils.TritonError(f"all {self.max_slots} slots are busy", pb_utils.TritonError.UNAVAILABLE)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            self.busy += 1
            thread = threading.Thread(target=self.serve, args=(request, sender, job), daemon=True)
            thread.start()
            self.threads.append(thread)
        self.threads = [t for t in self.threads if t.is_alive()]

    def serve(self, request, sender, job):
        """Run one request; every call into the backend holds `self.backend` (one at a time)."""
        with self.backend:
            self.live.increment(1)
        try:
            self.generate(request, sender, job)
        except Exception as exc:  # the request must still get its final response
            error = pb_utils.TritonError(f"toy engine failed: {exc}")
            with self.backend:
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        finally:
            with self.backend:
                self.live.increment(-1)
                self.busy -= 1

    def parse(self, request):
        max_tokens = int(scalar(request, "max_tokens", 0))
        if max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be positive, got {max_tokens}")
        k = int(scalar(request, "num_draft_tokens", DEFAULT_DRAFT_TOKENS))
        if not 0 <= k <= self.max_draft:
            raise InvalidRequest(f"num_draft_tokens must lie in [0, {self.max_draft}], got {k}")
        temperature = float(scalar(request, "temperature", 0.0))
        if temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {temperature}")
        stops = optional(request, "stop_words", np.array([], dtype=object)).reshape(-1)
        return {
            "ids": prompt_ids(request),
            "max_tokens": max_tokens,
            "k": k,
            "temperature": temperature,
            "seed": scalar(request, "seed", None),
            "stops": [s.decode() if isinstance(s, bytes) else str(s) for s in stops],
            "logprobs": bool(scalar(request, "return_logprobs", False)),
            "stream": bool(scalar(request, "stream", False)),
        }

    def generate(self, request, sender, job):
        rng = np.random.default_rng(None if job["seed"] is None else int(job["seed"]))
        k, out, logprobs = job["k"], [], []
        accepted_per_position = np.zeros(k, dtype=np.int32)  # [k]
        drafts = accepted = 0
        finish, sent = "length", 0
        step, last = 0, int(job["ids"][-1])
        held_back = max((len(s.encode()) - 1 for s in job["stops"]), default=0)
        while len(out) < job["max_tokens"]:
            with self.backend:
                cancelled = request.is_cancelled()
            if cancelled:
                finish = "cancelled"
                break
            time.sleep(self.step_delay)
            if step == 0:
                drafted = hits = 0  # prefill emits the first token
            else:
                drafted = min(k, job["max_tokens"] - len(out) - 1)
                hits = min(step % (k + 1), drafted)
            drafts, accepted = drafts + drafted, accepted + hits
            accepted_per_position[:hits] += 1
            for _ in range(hits + 1):
                if job["temperature"] > 0:
                    last = 97 + int(rng.integers(26))
                else:
                    last = 97 + (7 * last + 3) % 26
                out.append(last)
                logprobs.append(-0.25 * (1 + len(out) % 3))
            step += 1
            text = decode(out)
            cut = min((text.find(s) for s in job["stops"] if s and s in text), default=-1)
            if cut >= 0:
                del out[cut:], logprobs[cut:]
                finish = "stop"
                break
            ready = len(out) - held_back  # a stop word may still be completed by the next step
            if job["stream"] and len(out) < job["max_tokens"] and ready > sent:
                with self.backend:
                    sender.send(self.response(out[sent:ready], logprobs[sent:ready], job, None))
                sent = ready
        totals = {
            "num_input_tokens": len(job["ids"]),
            "num_output_tokens": len(out),
            "total_draft_tokens": drafts,
            "total_accepted_draft_tokens": accepted,
            "accepted_per_position": accepted_per_position,
            "finish_reason": finish,
        }
        first = sent if job["stream"] else 0
        with self.backend:
            self.finished[finish].increment(1)
            final = self.response(out[first:], logprobs[first:], job, totals)
            sender.send(final, flags=FINAL)

    @staticmethod
    def response(ids, logprobs, job, totals):
        tensors = [
            pb_utils.Tensor("text_output", np.array([decode(ids).encode()], dtype=object)),  # [1]
            pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32)),  # [n]
        ]
        if job["logprobs"]:
            tensors.append(pb_utils.Tensor("logprobs", np.array(logprobs, dtype=np.float32)))  # [n]
        if totals is not None:
            reason = np.array([totals.pop("finish_reason").encode()], dtype=object)  # [1]
            tensors.append(pb_utils.Tensor("finish_reason", reason))
            tensors.append(pb_utils.Tensor("accepted_per_position", totals.pop("accepted_per_position")))  # [k]
            tensors.extend(pb_utils.Tensor(name, np.array([v], dtype=np.int32)) for name, v in totals.items())  # [1]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=5)

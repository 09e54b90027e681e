"""A vLLM general plugin that injects one regression into the engine that loads it.

Put this folder on the engine's PYTHONPATH and name the regression in
``REPLAY_PROXY_INJECT``; vLLM finds the plugin through its entry point
(group ``vllm.general_plugins``, in the dist-info beside this file) and calls
``register`` in each process it starts. No file of vLLM is changed: the
plugin wraps vLLM's own functions (written against 0.32.0's v1 engine).

Kinds, each a bug a release could really bring:

* ``temperature-ignored``: the sampler samples at temperature 1 whatever was asked (greedy stays greedy);
* ``top-p-ignored``: the nucleus is never cut;
* ``sampler-scaled``: the logits reach the sampler scaled by 1.25 (a temperature of 0.8 applied twice, a
  bad cast between model and sampler): the model's own logits, and so every prompt logprob and every greedy
  token, are unchanged;
* ``penalty-unasked``: a presence penalty of 1.0 applied to every request, asked for or not;
* ``numerics-slight``: every logit scaled by 1.05: the same argmax, every distribution a little sharper;
* ``numerics-strong``: every logit scaled by 0.8 plus a fixed offset per vocabulary slot (std 0.5);
* ``vocab-slot``: one slot's logit is -inf, so that token is never produced
  (``REPLAY_PROXY_INJECT_TOKEN``, default 100);
* ``stop-ignored``: a request's ``stop_token_ids`` no longer end it (EOS and max_tokens still do);
* ``seed-ignored``: seeded requests sample from the engine's shared generator instead of their own.

``REPLAY_PROXY_INJECT`` empty or unset: the plugin does nothing (the same build, loaded the same way).
"""

import dataclasses
import functools
import os

KINDS = ("temperature-ignored", "top-p-ignored", "sampler-scaled", "penalty-unasked", "numerics-slight",
         "numerics-strong", "vocab-slot", "stop-ignored", "seed-ignored")
SAMPLER_KINDS = ("temperature-ignored", "top-p-ignored", "sampler-scaled", "seed-ignored")


def register() -> None:
    kind = os.environ.get("REPLAY_PROXY_INJECT", "")
    if not kind:
        return
    if kind not in KINDS:
        raise ValueError(f"REPLAY_PROXY_INJECT={kind!r}: one of {', '.join(KINDS)}")
    if getattr(register, "done", False):  # vLLM may load plugins more than once in a process
        return
    register.done = True
    if kind in SAMPLER_KINDS:
        _patch_sampler(kind)
    elif kind == "stop-ignored":
        _patch_stop()
    elif kind == "penalty-unasked":
        _patch_penalty()
    else:
        _patch_logits(kind)


def _patch_sampler(kind: str) -> None:
    import torch
    from vllm.v1.sample.sampler import Sampler

    original = Sampler.forward

    @functools.wraps(original)
    def forward(self, logits, sampling_metadata, *args, **kwargs):
        m = sampling_metadata
        if kind == "temperature-ignored" and m.temperature is not None:
            m = dataclasses.replace(m, temperature=torch.where(m.temperature < 1e-5, m.temperature,
                                                               torch.ones_like(m.temperature)))
        elif kind == "top-p-ignored":
            m = dataclasses.replace(m, top_p=None)
        elif kind == "seed-ignored":
            m = dataclasses.replace(m, generators={})
        elif kind == "sampler-scaled":
            logits = logits * 1.25
        return original(self, logits, m, *args, **kwargs)

    Sampler.forward = forward


def _patch_logits(kind: str) -> None:
    import torch
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    original = LogitsProcessor.forward
    slot = int(os.environ.get("REPLAY_PROXY_INJECT_TOKEN", "100"))
    offsets = {}

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        logits = original(self, *args, **kwargs)
        if logits is None:
            return logits
        if kind == "numerics-slight":
            return logits * 1.05
        if kind == "numerics-strong":
            width = logits.shape[-1]
            if width not in offsets:
                offsets[width] = torch.randn(width, generator=torch.Generator().manual_seed(7)) * 0.5
            return logits * 0.8 + offsets[width].to(logits.dtype)
        logits = logits.clone()
        logits[..., slot] = float("-inf")
        return logits

    LogitsProcessor.forward = forward


def _patch_stop() -> None:
    import vllm.v1.core.sched.scheduler as scheduler

    original = scheduler.check_stop

    @functools.wraps(original)
    def check_stop(request, max_model_len, *args, **kwargs):
        params = request.sampling_params
        if params is None or not params.stop_token_ids:
            return original(request, max_model_len, *args, **kwargs)
        kept = params.stop_token_ids
        params.stop_token_ids = []
        try:
            return original(request, max_model_len, *args, **kwargs)
        finally:
            params.stop_token_ids = kept

    scheduler.check_stop = check_stop


def _patch_penalty() -> None:
    """Each request joins the model runner's batch with a presence penalty of 1.0 where it asked for none (a
    default changed): the batch then tracks its generated tokens, and the sampler penalizes them."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    original = InputBatch.add_request

    @functools.wraps(original)
    def add_request(self, request):
        params = request.sampling_params
        if params is not None and params.presence_penalty == 0.0:
            params.presence_penalty = 1.0
        return original(self, request)

    InputBatch.add_request = add_request

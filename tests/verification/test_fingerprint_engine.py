"""Answer fingerprints against the real engine: llama-cpp-python's server with SmolLM2-135M, and
the same GGUF with its weights changed (written with the `gguf` package), served under the same
name. Each machine's run asks its engine the canary prompts through the real load test; the
changed one is flagged "serves a different model than it names", and an honest engine of the
same model and quantization passes."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from marketplace.models import Card
from tests.engine import ALIAS, ENGINE_AVAILABLE, NOT_INSTALLED, gguf_path, llama_server
from tests.verification.test_pipeline import enrolled_node, h200_probe, h200_report
from verification import fingerprint, services
from verification.models import Finding, VerificationRun

pytestmark = [pytest.mark.real_engine, pytest.mark.django_db(transaction=True)]


def changed_copy(directory: Path) -> Path:
    """SmolLM2's GGUF with the weights of every feed-forward output projection moved by one
    quantization block within each row: the same file type, size and name, other weights."""
    copy = directory / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shutil.copyfile(gguf_path(), copy)
    reader = gguf.GGUFReader(copy, "r+")
    changed = 0
    for tensor in reader.tensors:
        if tensor.name.endswith("ffn_down.weight"):
            _, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
            rows = tensor.data.reshape(tensor.data.shape[0], -1)
            rows[...] = np.roll(rows, type_size, axis=1)
            changed += 1
    reader.data.flush()
    assert changed >= 10
    return copy


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(peer, changed, honest): three servers under the same name, the second of changed
    weights."""
    if not ENGINE_AVAILABLE:
        pytest.fail(NOT_INSTALLED)
    changed = changed_copy(tmp_path_factory.mktemp("changed"))
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(llama_server(n_ctx=512, model=model, n_threads=1))
                for model in (None, changed, None)]
        yield urls


def judged(owner, url: str, uuid: str, settings) -> VerificationRun:
    """A machine serving SmolLM2 at `url`, its run through the load test, evaluation and
    publication."""
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1,)
    report = h200_report(uuid=uuid, engine_url=url, reachable=True)
    report["engine"].update(models=[ALIAS], served=[{
        "id": ALIAS, "engine": "llama.cpp", "max_context": 512, "quantization": "Q4_1"}])
    node = enrolled_node(owner, report)
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    job = services.jobs_for_node(node.pk)[0]
    services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                               result=h200_probe(uuid=uuid))
    assert services.run_load_test(run_id=run.pk)
    assert services.run_evaluate(run_id=run.pk) and services.run_publish(run_id=run.pk)
    run.refresh_from_db()
    return run


def test_the_canary_answers_tell_changed_weights_from_the_model_they_claim(engines, bob,
                                                                          settings, gpu_specs):
    peer_url, changed_url, honest_url = engines
    peer = judged(bob, peer_url, "GPU-peer", settings)
    assert len(peer.fingerprint) == len(fingerprint.CANARIES)
    assert all(answer["tokens"] and answer["logprobs"] for answer in peer.fingerprint)
    first = Finding.objects.get(run=peer, metric="fingerprint")
    assert first.severity == "not_measured" and "kept" in first.message
    # The first machine serving it was verified (its serving judged as every machine's is;
    # here its hardware report is an H200's, so it is set by hand).
    Card.objects.filter(node=peer.node).update(verification_status="verified")

    changed = judged(bob, changed_url, "GPU-changed", settings)
    found = Finding.objects.get(run=changed, metric="fingerprint")
    assert found.severity == "mismatch", found.message
    assert "serves a different model than it names" in found.message.lower()

    honest = judged(bob, honest_url, "GPU-honest", settings)
    found = Finding.objects.get(run=honest, metric="fingerprint")
    assert found.severity == "ok", (found.message, honest.error, honest.fingerprint)
    assert fingerprint.match(honest.fingerprint, peer.fingerprint).agreed == len(
        fingerprint.CANARIES)
    assert not fingerprint.match(changed.fingerprint, peer.fingerprint).matches

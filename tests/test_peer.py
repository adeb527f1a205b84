"""The llama.cpp peer bench's host side: a completion read from a llama-server-shaped endpoint, and the
side-by-side report (building llama.cpp itself takes ~15 minutes: `python -m specjax.bench.peer`)."""

import http.server
import io
import json
import threading

import pytest

from specjax.bench import peer
from specjax.bench.prompts import Prompt


@pytest.fixture
def fake_server():
    """A loopback server answering `/completion` as llama-server does, recording the bodies it got."""
    bodies = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            n = body["n_predict"]
            out = dict(tokens=list(range(100, 100 + n - 1)), stop_type="eos",
                       timings=dict(predicted_per_second=123.5))
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", bodies
    srv.shutdown()


def test_complete_sends_token_ids_greedy_and_counts_the_stop_token(fake_server):
    url, bodies = fake_server
    run = peer.complete(url, [1, 2, 3], 5, stop_ids=(2,))
    assert bodies[0]["prompt"] == [1, 2, 3] and bodies[0]["temperature"] == 0.0
    assert bodies[0]["cache_prompt"] is False and bodies[0]["return_tokens"] is True
    assert run.tokens == [100, 101, 102, 103, 2]  # an EOS stop keeps the stop token, as specjax does
    assert run.decode_tps == 123.5 and run.seconds > 0


def test_report_compares_every_arm_with_llama_cpp_plain_and_specjax_plain():
    base = [peer.Run([1, 2, 3, 4], 0.1), peer.Run([5, 6], 0.1)]
    rec = dict(
        prompts=[Prompt(0, "a", "qa"), Prompt(1, "b", "rag")], gguf="/x/model.gguf", llama_bench=[150.0, 170.0],
        runs={"llama.cpp plain": [[peer.Run([1, 2, 9, 9], 0.04, 200.0), peer.Run([5, 6], 0.02, 210.0)]],
              "specjax plain": [base]})
    out = io.StringIO()
    table = peer.report(rec, out)
    assert table["llama_bench"] == 160.0
    assert table["arms"]["llama.cpp plain"]["tok_s"] == pytest.approx(6 / 0.06)
    assert table["arms"]["specjax plain"]["tok_s"] == pytest.approx(6 / 0.2)
    assert table["arms"]["llama.cpp plain"]["shared_prefix"] == [2, 2]
    assert table["arms"]["llama.cpp plain"]["identical"] == 1
    assert "0.30x" in out.getvalue()  # specjax plain against llama.cpp plain
    # per task class: qa 4 tokens in 0.1 s against 4 in 0.04 s, rag 2 in 0.1 s against 2 in 0.02 s
    assert table["arms"]["specjax plain"]["per_class"] == pytest.approx({"qa": 40.0, "rag": 20.0})
    assert "qa 40.0 (0.40x)  rag 20.0 (0.20x)" in out.getvalue()


def test_report_holds_each_arithmetics_arms_to_its_own_plain_loop():
    """`--weights-arith exact,q8`: a q8 arm is compared with specjax's q8 plain loop, an exact one with
    the exact plain loop."""
    exact, q8 = [peer.Run([1, 2, 3], 0.1)], [peer.Run([1, 7, 7], 0.1)]
    rec = dict(prompts=[Prompt(0, "a", "qa")], gguf="/x/model.gguf", llama_bench=[100.0],
               runs={"llama.cpp plain": [[peer.Run([1, 2, 9], 0.05)]], "specjax plain": [exact],
                     "specjax ngram k=4": [[peer.Run([1, 2, 3], 0.08)]], "specjax plain q8": [q8],
                     "specjax ngram k=4 q8": [[peer.Run([1, 7, 7], 0.07)]]})
    arms = peer.report(rec, io.StringIO())["arms"]
    assert arms["specjax ngram k=4 q8"]["identical"] == 1 and arms["specjax plain q8"]["identical"] == 1
    assert arms["specjax ngram k=4"]["identical"] == 1
    assert arms["llama.cpp plain"]["shared_prefix"] == [2]  # against specjax's exact plain


def test_a_build_that_dies_on_a_batched_product_is_detected(tmp_path):
    """`runs_batched`: a llama-bench killed by a signal (an AMX instruction a virtual machine lists and
    faults on) is caught, so `measure` builds without AMX; one that exits 0 passes."""
    bench = tmp_path / "llama-bench"
    bench.write_text("#!/bin/sh\nkill -ILL $$\n")
    bench.chmod(0o755)
    assert not peer.runs_batched(tmp_path, "model.gguf")
    bench.write_text("#!/bin/sh\nexit 0\n")
    assert peer.runs_batched(tmp_path, "model.gguf")

"""CPU smoke of the benchmark harness: bench/gpu_bench.sh end to end, the standalone loop, the realistic floor."""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tiny_config import tiny_config
from triton_mtp.export.model import DeepseekV3Target
from triton_mtp.export.synthetic import random_weights, write_checkpoint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.realistic import bytes_touched, parse_variants, v2_lite_config  # noqa: E402
from bench.triton_ab import ab_repository  # noqa: E402
from bench.warm_up import served_shapes  # noqa: E402


def perfect_drafter_checkpoint(out: Path) -> Path:
    """A tiny checkpoint whose MTP layers always draft the target's greedy tokens.

    Every attention and MLP output projection is zero, so the target's next token is a fixed function
    f of the current one: lm_head(norm(embed(t))). Each MTP layer's eh_proj keeps only the embedding
    half and its shared_head.norm is the target's norm, so from the pair (t_{i+1}, h_i) it predicts
    f(t_{i+1}) = t_{i+2}: exactly the token the target emits next. EOS gets a zero head row, so it is
    never the argmax and every request runs to max_tokens.
    """
    cfg = tiny_config()
    weights = random_weights(cfg, seed=0)
    H, N = cfg["hidden_size"], cfg["num_hidden_layers"]
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    weights["lm_head.weight"][cfg["eos_token_id"]] = 0.0
    for i in range(N, N + cfg["num_nextn_predict_layers"]):
        prefix = f"model.layers.{i}."
        weights[prefix + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)  # [H, 2H]
        weights[prefix + "enorm.weight"] = torch.ones(H)
        weights[prefix + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
        weights[prefix + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    out.mkdir(parents=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    """bench/gpu_bench.sh with BENCH_SMOKE=1 over the perfect-drafter checkpoint; its $OUT."""
    root = tmp_path_factory.mktemp("bench")
    checkpoint = perfect_drafter_checkpoint(root / "checkpoint")
    out = root / "out"
    env = {**os.environ, "OUT": str(out), "BENCH_SMOKE": "1"}
    env.pop("BENCH_REPOSITORY", None)
    done = subprocess.run(["bash", "bench/gpu_bench.sh", str(checkpoint)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    log = (out / "bench.log").read_text() if (out / "bench.log").exists() else done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    return out


def test_smoke_run_writes_every_stage_and_the_targets(smoke_run):
    results = json.loads((smoke_run / "results.json").read_text())
    assert {"standalone", "hf_generate", "realistic", "triton", "triton_local"} <= results.keys(), \
        (smoke_run / "bench.log").read_text()[-3000:]
    assert set(results["targets"]) == {"bls", "local"}
    for hops, targets in results["targets"].items():
        for name in ("P1", "P2", "P4", "P5"):
            assert targets[name] > 0, (hops, name)
        assert targets["P3"] is None  # the smoke sweep stops at 2 streams
    report = (smoke_run / "results.md").read_text()
    assert "| P1 |" in report and "bls ratio | bls result | local ratio | local result" in report
    assert "| Triton (local) k=2 |" in report and "## Concurrency sweep" in report and "## Realistic configuration" in report
    assert "grouped_mm" in (smoke_run / "realistic_profile.txt").read_text()  # the grouped MoE's step, profiled
    assert len(list(smoke_run.iterdir())) <= 8


def test_smoke_run_through_triton_accepts_every_perfect_draft(smoke_run):
    triton = json.loads((smoke_run / "results.json").read_text())["triton"]
    plain = triton["batch1"]["0"]
    assert plain["output_tokens"] == 2 * 16 and plain["hops_per_token"] == 1.0
    assert plain["models"]["mtp"]["calls"] == 0 and plain["models"]["target"]["calls"] == 32  # a prefill + 15 steps each
    for k in ("0", "1", "2"):  # the engine's hop counter agrees with the calls the hop models served
        models = triton["batch1"][k]["models"]
        assert triton["batch1"][k]["hops"] == models["target"]["calls"] + models["mtp"]["calls"], k
    assert 0 < plain["models"]["target"]["compute_ms"] <= plain["models"]["target"]["request_ms"]
    for k in (1, 2):
        run = triton["batch1"][str(k)]
        assert run["output_tokens"] == 2 * 16
        assert run["acceptance_per_position"] == [1.0] * k
        assert run["mean_accepted_length"] == k + 1
    assert triton["batch1"]["2"]["hops_per_token"] < 0.75  # 2 hops emit 3 tokens after the prefill hop
    assert set(triton["sweep"]) == {"plain", "spec"} and set(triton["sweep"]["spec"]) == {"1", "2"}


def test_smoke_run_with_local_hops_makes_no_hop_and_accepts_every_perfect_draft(smoke_run):
    results = json.loads((smoke_run / "results.json").read_text())
    local = results["triton_local"]
    for k in ("0", "1", "2"):
        run = local["batch1"][k]
        assert run["output_tokens"] == 2 * 16 and run["outputs"] == results["triton"]["batch1"][k]["outputs"]
        assert run["models"]["target"]["calls"] == run["models"]["mtp"]["calls"] == 0  # no hop model exists
        # the same worker calls, in process, except at a request's end: its last chained call drafts in full
        # (a chained call counts two hops), and the call launched ahead of it is left unread (two more)
        bls_hops = results["triton"]["batch1"][k]["hops"]
        extra = run["hops"] - bls_hops
        assert bls_hops > 0 and (extra == 0 if k == "0" else 0 <= extra <= 3 * len(run["outputs"]))
        assert results["triton"]["batch1"][k]["chained_calls"] == 0  # BLS hops: drafts from the mtp model
        assert (run["chained_calls"] > 0) == (k != "0")  # greedy drafts chained to the verify, on the device
    assert local["batch1"]["2"]["acceptance_per_position"] == [1.0, 1.0]


def test_smoke_run_standalone_matches_the_server(smoke_run):
    results = json.loads((smoke_run / "results.json").read_text())
    everything = {"0": [2, 2], "1": [2, 2], "2": [2, 2]}
    assert results["triton_equals_standalone"] == {"bls": everything, "local": everything}
    for k in ("1", "2"):
        run = results["standalone"]["runs"][k]
        assert run["same_tokens_as_plain"]
        assert run["acceptance_per_position"] == results["triton"]["batch1"][k]["acceptance_per_position"]


def test_standalone_speculative_greedy_equals_plain_greedy(tmp_path):
    """Random weights: drafts are mostly rejected, and the tokens must still be plain decoding's."""
    checkpoint = write_checkpoint(tmp_path / "checkpoint", tiny_config(), seed=3)
    out = tmp_path / "standalone.json"
    done = run_module("bench.standalone", "--checkpoint", str(checkpoint), "--out", str(out), "--device", "cpu",
                      "--dtype", "fp32", "--graphs", "eager", "--draft-tokens", "1,3", "--prompts", "2",
                      "--prompt-tokens", "12", "--max-tokens", "14")
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert runs["0"]["output_tokens"] > 0
    for k in ("1", "3"):
        assert runs[k]["same_tokens_as_plain"], k
        assert runs[k]["output_tokens"] == runs["0"]["output_tokens"]


def test_standalone_rejects_graph_modes_without_cuda(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "checkpoint", tiny_config(), seed=0)
    done = run_module("bench.standalone", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "s.json"),
                      "--device", "cpu", "--dtype", "fp32", "--graphs", "cudagraph", "--prompts", "1",
                      "--prompt-tokens", "8", "--max-tokens", "4")
    assert done.returncode != 0
    assert "graphs: mode 'cudagraph' needs CUDA tensors" in done.stderr


def test_v2_lite_floor_counts_the_published_parameters_per_step():
    """2.45 B parameters touched per decode step with top-6 of 64 experts (the issue's 1.15 ms floor)."""
    config = v2_lite_config()
    with torch.device("meta"):
        target = DeepseekV3Target(config, max_slots=1, max_seq_len=16).to(torch.bfloat16)
    assert abs(bytes_touched(config, target, selected=True) / 2 / 1e9 - 2.45) < 0.01
    assert bytes_touched(config, target, selected=False) / 2 / 1e9 > 15


def test_warm_up_calls_every_shape_the_decode_graphs_capture():
    # batch buckets 1, 2, 4, 8, 12 x 1 and 5 tokens, then the prompt families of 16, 32 and 64 tokens within 64
    assert served_shapes(12, 5, 64) == [(b, t) for b in (1, 2, 4, 8, 12) for t in (1, 5)] + [
        (1, 16), (2, 16), (4, 16), (1, 32), (2, 32), (1, 64)]
    assert served_shapes(2, 1, 0) == [(1, 1), (2, 1)]  # one-token calls, no prompt graphs


def test_realistic_refuses_the_dense_moe_after_a_grouped_one():
    """Grouping the experts cannot be undone, so a dense variant after a grouped one would time the grouped MoE."""
    assert parse_variants("dense,selected,fused") == ["dense", "selected", "fused"]
    assert parse_variants("fused,fused-apart") == ["fused", "fused-apart"]  # the shared experts fold and unfold
    for bad in ("fused,dense", "selected,dense", "dense,sparse"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variants(bad)


@pytest.mark.parametrize("hops", ["bls", "local"])  # the artifacts under target/ and mtp/, or inside spec_decode/
def test_capture_check_reports_each_model_of_a_repository(tmp_path, hops):
    """On CPU nothing captures; the check still loads the format's steps, times them and says why."""
    from triton_mtp.export.repository import write_repository

    checkpoint = write_checkpoint(tmp_path / "checkpoint", tiny_config(), seed=0)
    write_repository(checkpoint, tmp_path / "repo", fmt="eager", max_slots=2, max_seq_len=32, max_draft_tokens=2,
                     eager_compile=False, hops=hops, progress=False)
    out = tmp_path / "capture.json"
    done = run_module("bench.capture_check", "--repository", str(tmp_path / "repo"), "--out", str(out),
                      "--device", "cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    (found,) = json.loads(out.read_text())["repositories"].values()
    assert found["format"] == "eager"
    for model in ("target", "mtp"):
        assert found[model]["eager_ms"] > 0 and found[model]["host_sync"] is None
        assert not found[model]["captured"] and "CUDA" in found[model]["error"], found[model]


def test_detokenize_bench_compares_both_paths_on_held_out_outputs(tmp_path):
    out = tmp_path / "detokenize.json"
    done = run_module("bench.detokenize", "--lengths", "64", "--tokens-per-step", "3", "--sequences", "1",
                      "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["output_tokens"] == 64 and row["steps"] == 22
    assert row["whole_decode_ms"] > 0 and row["text_stream_ms"] > 0


def test_triton_ab_refuses_a_code_change_over_bls_hops(tmp_path):
    """With BLS hops the target and mtp models would still run the export's code: the A/B would not be one."""
    model = tmp_path / "repo" / "spec_decode"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "spec_decode"\nparameters { key: "hops", value: { string_value: "bls" } }\n')
    (tmp_path / "ab").mkdir()
    with pytest.raises(ValueError, match="code needs an export --hops local"):
        ab_repository(tmp_path / "repo", [f"code={REPO}"], tmp_path / "ab")
    assert [p.name for p in (tmp_path / "ab").iterdir()] == ["spec_decode"]  # nothing written for the change


def test_gil_release_bench_times_each_call_alone_and_beside_a_python_thread(tmp_path):
    out = tmp_path / "gil.json"
    done = run_module("bench.gil_release", "--calls", "200", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    calls = json.loads(out.read_text())["per_call_us"]
    assert {"tensor.view", "tensor.copy_", "python list slice"} <= set(calls)
    assert all(row["alone"] > 0 and row["beside_a_python_thread"] > 0 for row in calls.values())


def test_engine_overhead_steps_the_same_on_a_second_thread(tmp_path):
    runs = {}
    for where, flags in (("main", ()), ("thread", ("--thread",))):
        out = tmp_path / f"{where}.json"
        done = run_module("bench.engine_overhead", "--checkpoint", str(REPO / "models" / "tiny-dsv3-mtp"), "--prompts", "1",
                          "--max-slots", "4", "--prompt-tokens", "8", "--max-tokens", "12", "--draft-tokens", "0,3",
                          *flags, "--out", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(out.read_text())
        assert {r["stepped_on"] for r in result["runs"].values()} == {"engine-steps_0" if flags else "MainThread"}
        runs[where] = {k: (r["steps"], r["tokens"]) for k, r in result["runs"].items()}
    assert runs["main"]["0"] == (12, 12)
    assert runs["thread"] == runs["main"]  # greedy fp32: the same steps and tokens wherever the loop runs


def test_cpu_threads_bench_times_each_setting_from_both_threads(tmp_path):
    out = tmp_path / "cpu_threads.json"
    done = run_module("bench.cpu_threads", "--checkpoint", str(REPO / "models" / "tiny-dsv3-mtp"), "--tokens", "1,5",
                      "--repeats", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    settings = json.loads(out.read_text())["settings"]
    cases = {f"{where} thread, {T} token(s)" for where in ("main", "second") for T in (1, 5)}
    assert {name: s["mkl_num_threads"] for name, s in settings.items()} == {"MKL default": None, "MKL_NUM_THREADS=1": "1"}
    assert all(set(s["ms"]) == cases and all(t > 0 for t in s["ms"].values()) for s in settings.values())


def test_null_replays_run_each_step_once_and_time_the_decode_steps_alone(tmp_path):
    """A null replay returns its capture's outputs without running; over them the engine's decode steps
    cost the host's work alone, the prefill (eager) runs untimed, and --graphs needs them off CUDA."""
    from bench.engine_overhead import NullReplay

    calls = []

    def step(x):
        calls.append(x.clone())
        return (x + 1,)

    replay = NullReplay(step, [torch.zeros(2)])
    first, again = replay(torch.ones(2)), replay(torch.full((2,), 5.0))
    assert len(calls) == 1 and again[0] is first[0] and first[0].tolist() == [1.0, 1.0]
    out = tmp_path / "null.json"
    done = run_module("bench.engine_overhead", "--checkpoint", str(REPO / "models" / "tiny-dsv3-mtp"), "--graphs",
                      "--null-replays", "--prompts", "2", "--max-slots", "4", "--prompt-tokens", "8", "--max-tokens", "12",
                      "--draft-tokens", "0", "--overlap", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["null_replays"] and result["runs"]["0"]["steps"] == 11  # 12 tokens a row, the first untimed
    assert result["runs"]["0"]["tokens"] == 2 * 11 and result["runs"]["0"]["step_ms"] > 0
    assert result["runs"]["0"]["streamed_responses"] == 0  # not streamed: each request answers once, at the end
    streamed = tmp_path / "streamed.json"
    done = run_module("bench.engine_overhead", "--checkpoint", str(REPO / "models" / "tiny-dsv3-mtp"), "--graphs",
                      "--null-replays", "--prompts", "2", "--max-slots", "4", "--prompt-tokens", "8", "--max-tokens", "12",
                      "--draft-tokens", "0", "--overlap", "--stream", "4", "--out", str(streamed))
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(streamed.read_text())["runs"]
    assert (runs["0"]["steps"], runs["0"]["tokens"]) == (11, 22)  # streaming changes the host's work, not the steps
    # a row streams its first token at once (untimed step), then once 4 are unsent: after tokens 5 and 9
    assert runs["0"]["streamed_responses"] == 2 * 2
    refused = run_module("bench.engine_overhead", "--checkpoint", str(REPO / "models" / "tiny-dsv3-mtp"), "--graphs")
    assert refused.returncode != 0 and "--graphs needs --device cuda" in refused.stderr


def test_closed_loop_streams_resubmit_and_every_call_goes_ahead(tmp_path):
    """engine_overhead --requests-per-prompt: each prompt a stream of that many requests, the first ones asking for
    fewer tokens so the streams end apart; with null prompt graphs and overlap, every target call after the first
    step, the prompts' calls of requests arriving mid-run included, is launched before the previous one is read."""
    out = tmp_path / "arrivals.json"
    done = run_module("bench.engine_overhead", "--checkpoint", str(REPO / "models" / "tiny-dsv3-mtp"), "--graphs",
                      "--null-replays", "--prompts", "4", "--max-slots", "4", "--prompt-tokens", "8", "--max-tokens", "8",
                      "--draft-tokens", "0", "--overlap", "--requests-per-prompt", "3", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    run = result["runs"]["0"]
    assert result["requests_per_prompt"] == 3
    # 4 streams: a first request of 2, 4, 6 and 8 tokens, then two of 8 each; the first step's 4 tokens untimed
    assert run["tokens"] == (2 + 4 + 6 + 8) + 4 * 2 * 8 - 4
    assert run["hops"] > run["steps"]  # prompts of arriving requests in calls of their own
    assert run["calls_ahead"] == run["hops"]


def test_chain_check_finds_the_chain_graph_agreeing(drafting_checkpoint, tmp_path):
    """On CPU with stand-in graphs: every case agrees across the three sets of workers, and the chained calls
    replayed the chain graph (a GPU run checks the capture the same way)."""
    out = tmp_path / "chain_check.json"
    done = run_module("bench.chain_check", "--checkpoint", str(drafting_checkpoint), "--device", "cpu",
                      "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 4 and all(case["agree"] for case in cases)
    assert all(case["chain_replays"] > 0 for case in cases)
    assert any(accepted for case in cases for accepted, _ in case["accepted_of_drafted"])  # drafts were kept


def test_triton_ab_serves_each_change_beside_the_export_in_one_server(tmp_path):
    """gpu_bench's triton_local_ab stage (bench/triton_ab.py): the server loads the export and one model per change;
    each model runs with its parameters as changed, or with the code of another tree of the project (`code`, a path
    relative to where the script starts), and emits the export's greedy tokens (the same weights)."""
    checkpoint = perfect_drafter_checkpoint(tmp_path / "checkpoint")
    tree = tmp_path / "tree"  # the project's code, its spec_decode marked so that the log shows which code served
    for package in ("triton_mtp", "serving", "export", "client", "train", "model_repository", "bench"):
        shutil.copytree(REPO / package, tree / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
    model_py = tree / "model_repository" / "spec_decode" / "1" / "model.py"
    model_py.write_text(model_py.read_text().replace(
        "    def initialize(self, args):\n", "    def initialize(self, args):\n        triton_io.log('spec_decode: the tree copy')\n"))
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "BENCH_SMOKE": "1", "BENCH_ONLY": "export_local triton_local_ab",
           "BENCH_AB": f"response_lag_steps=1 stream_interval=3,spec_disable_rows=1 code={os.path.relpath(tree, REPO)}",
           "BENCH_AB_ROUNDS": "2",
           "BENCH_AB_REQUESTS_PER_STREAM": "1", "BENCH_RESPONSE_THREADS": "1"}
    env.pop("BENCH_REPOSITORY", None)
    done = subprocess.run(["bash", "bench/gpu_bench.sh", str(checkpoint)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    log = (out / "bench.log").read_text() if (out / "bench.log").exists() else done.stdout + done.stderr
    assert done.returncode == 0 and (out / "ab.json").is_file(), log[-3000:]
    result = json.loads((out / "ab.json").read_text())
    assert result["models"] == {"spec_decode": "", "spec_decode_ab0": "response_lag_steps=1",
                                "spec_decode_ab1": "stream_interval=3,spec_disable_rows=1", "spec_decode_ab2": f"code={tree}"}
    served = result["parameters"]
    assert [served[m]["response_lag_steps"] for m in result["models"]] == ["0", "1", "0", "0"]
    assert [(served[m]["stream_interval"], served[m]["spec_disable_rows"]) for m in result["models"]] == \
        [("1", "0"), ("1", "0"), ("3", "1"), ("1", "0")]
    assert (out / "server_ab.log").read_text().count("spec_decode: the tree copy") == 1  # the code model alone
    assert len(result["rounds"]) == 2
    for measured in result["rounds"]:
        for k in ("0", "2"):  # plain, and the smoke export's largest k
            export = measured["spec_decode"][k]["1"]["outputs"]
            assert len(export) == 2 and all(len(ids) == 16 for ids in export)
            for model in result["models"]:
                assert set(measured[model][k]) == {"1", "2"}
                assert measured[model][k]["2"]["output_tokens"] == 2 * 16  # a request per stream
                assert measured[model][k]["1"]["outputs"] == export, (model, k)
        assert measured["spec_decode_ab0"]["2"]["1"]["acceptance_per_position"][0] == 1.0  # it drafts, perfectly
        assert measured["spec_decode"]["2"]["2"]["steps"] > 0
    mean = result["mean_tokens_per_s"]["spec_decode_ab1"]["2"]["2"]
    assert mean == pytest.approx(sum(r["spec_decode_ab1"]["2"]["2"]["tokens_per_s"] for r in result["rounds"]) / 2)


def test_triton_ab_refuses_a_change_of_no_parameter():
    from bench.triton_ab import changed_config

    config = 'name: "spec_decode"\nparameters { key: "stream_interval", value: { string_value: "1" } }\n'
    assert changed_config(config, "spec_decode_ab0", "stream_interval=4") == \
        'name: "spec_decode_ab0"\nparameters { key: "stream_interval", value: { string_value: "4" } }\n'
    with pytest.raises(ValueError, match="no parameter 'overlap'"):
        changed_config(config, "spec_decode_ab0", "overlap=false")
    with pytest.raises(ValueError, match="not key=value"):
        changed_config(config, "spec_decode_ab0", "stream_interval")

"""`xrec serve --ray`'s checks that need no Ray cluster: options, flags and `build_app`'s
arguments are refused (or parsed) before Ray starts; the deployment's sizes. The paths
that need a cluster are in tests/test_ray.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

import xrec.scale.serve_app as serve_app  # noqa: E402
from xrec.cli import main  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.scale.serve_app import ServeOptions, build_app, check_fits  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0,
                              num_items=50)


@pytest.fixture
def ray_never_starts(monkeypatch) -> None:
    """`xrec serve --ray` fails the test where it would start Ray."""
    def serve_forever(*args, **kwargs):
        raise AssertionError("Ray would start")
    monkeypatch.setattr(serve_app, "serve_forever", serve_forever)


def bound_options(args: dict) -> ServeOptions:
    """The ServeOptions that `build_app(args)`'s replicas are built with."""
    return build_app(args)._bound_deployment.init_args[0]


def test_build_app_parses_text_as_xrec_serve_parses_flags(model_dir, monkeypatch):
    monkeypatch.delenv("XREC_API_KEY", raising=False)
    options = bound_options({"model": str(model_dir), "constrained": "false",
                             "fused_kernels": "on", "generation_prefix": "[151669]",
                             "max_replicas": "none", "replica_cpus": "0.5"})
    assert options.engine_options == {"constrained": False, "fused_kernels": True,
                                      "generation_prefix": (151669,)}
    assert (options.max_replicas, options.replica_cpus, options.api_key) == (None, 0.5, None)
    text = bound_options({"model": str(model_dir), "generation_prefix": "<|sid_begin|>"})
    assert text.engine_options == {"generation_prefix": "<|sid_begin|>"}
    # a config file's typed values stay as they are
    assert bound_options({"model": str(model_dir), "replicas": 2}).num_replicas == 2


@pytest.mark.parametrize("key, value, expected", [
    ("constrained", "ture", "true or false"),          # was False: constraints off
    ("fused_kernels", "yes please", "true or false"),
    ("replicas", "2.5", "an integer"),                 # was int()'s message, no key
    ("grace_s", "soon", "a number"),
    ("generation_prefix", "[1, oops", "text or a JSON list of token ids"),
])
def test_build_app_refuses_text_its_option_does_not_take(model_dir, key, value, expected):
    with pytest.raises(ValueError, match=f"^build_app: {key}: got {value!r}, expected "
                                         f"{expected}$".replace("[", "\\[")):
        build_app({"model": str(model_dir), key: value})


def test_build_app_reads_the_api_key_from_the_environment(model_dir, monkeypatch):
    """As `xrec serve --ray` does: with XREC_API_KEY set, auth was off under `serve run`."""
    monkeypatch.setenv("XREC_API_KEY", "secret")
    assert bound_options({"model": str(model_dir)}).api_key == "secret"
    assert bound_options({"model": str(model_dir), "api_key": "mine"}).api_key == "mine"


@pytest.mark.parametrize("options, message", [
    ({"engine_options": {"dtype": "bogus"}}, "option dtype: got 'bogus'"),
    ({"engine_options": {"max_seqs_per_batch": 0}}, "option max_seqs_per_batch: got 0"),
    ({"max_body_bytes": 0}, "--max-body-bytes: got 0, expected an integer >= 1"),
    ({"grace_s": float("nan")}, "--grace-s: got nan, expected seconds in \\[0, 86400\\]"),
    ({"grace_s": float("inf")}, "--grace-s: got inf, expected seconds in \\[0, 86400\\]"),
])
def test_serve_options_refuse_what_xrec_serve_refuses(model_dir, options, message):
    """Checked when the options are made, not by Serve after Ray started (or never)."""
    with pytest.raises(ValueError, match=message):
        ServeOptions(str(model_dir), **options)


def test_serve_options_refuse_a_model_directory_without_a_config(tmp_path, model_dir):
    with pytest.raises(ValueError, match="no config.json at /nonexistent/config.json"):
        ServeOptions("/nonexistent")
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ServeOptions(str(broken))


@pytest.mark.parametrize("flags, line", [
    (["--model", "/nonexistent"], "no config.json at /nonexistent/config.json"),
    (["--max-body-bytes", "0"], "--max-body-bytes: got 0, expected an integer >= 1"),
    (["--dtype", "bogus"], "option dtype: got 'bogus', allowed: 'auto', float32, bfloat16, "
                           "float16"),
    (["--grace-s", "inf"], "--grace-s: got inf, expected seconds in [0, 86400]"),
    (["--max-header-bytes", "1024"], "--max-header-bytes: connection limits are `xrec serve`'s "
     "own; with --ray, Ray Serve's proxy takes the connections (its RAY_SERVE_* settings)"),
    (["--header-timeout-s", "1", "--body-timeout-s", "1", "--keep-alive-s", "1",
      "--max-connections", "8"], "--header-timeout-s, --body-timeout-s, --keep-alive-s, "
     "--max-connections: connection limits are `xrec serve`'s own; with --ray, Ray Serve's "
     "proxy takes the connections (its RAY_SERVE_* settings)"),
    (["--port", "0"], "--port 0: --ray needs a fixed port (Serve's proxies listen on it on "
                      "every node, and report no port they picked)"),
])
def test_serve_ray_refuses_bad_flags_before_ray_starts(model_dir, ray_never_starts, capsys,
                                                       flags, line):
    """One error line and exit 1, as `xrec serve` gives; they were a traceback after Ray had
    started, a pydantic error, or accepted and ignored (the connection limits, --port 0)."""
    argv = ["serve", "--ray", "--model", str(model_dir), "--replica-cpus", "0.5", *flags]
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"xrec serve: error: {line}"


def test_replicas_the_cluster_cannot_hold_are_refused(model_dir):
    """Serve waits for a replica it cannot place without a limit: refused up front."""
    three = ServeOptions(str(model_dir), num_replicas=3, replica_cpus=1.0)
    check_fits(three, {"CPU": 3.0})
    with pytest.raises(ValueError, match=r"^--replicas 3 x --replica-cpus 1 = 3 CPU\(s\), but "
                                         r"the Ray cluster has 2 free; Serve would wait"):
        check_fits(three, {"CPU": 2.0, "GPU": 4.0})
    gpu = ServeOptions(str(model_dir), replica_cpus=0.5, replica_gpus=1.0)
    with pytest.raises(ValueError, match=r"--replica-gpus 1 = 1 GPU\(s\), but the Ray cluster "
                                         "has 0 free"):
        check_fits(gpu, {"CPU": 2.0})
    scaled = ServeOptions(str(model_dir), num_replicas=2, max_replicas=8, replica_cpus=1.0)
    check_fits(scaled, {"CPU": 2.0})   # autoscaling starts at --replicas


def test_a_full_replica_refuses_instead_of_queueing_in_the_proxy(model_dir):
    """Serve sends a replica at most max_ongoing_requests: at exactly the engine's capacity
    the engine never refused, and the proxy queued the rest without a bound (all 200,
    seconds late; timeout_ms counts from the replica)."""
    options = ServeOptions(str(model_dir), engine_options={"request_queue_size": 2,
                                                           "max_seqs_per_batch": 1})
    deployment = options.deployment_options()
    capacity = 2 + 1
    assert deployment["max_ongoing_requests"] == 2 * capacity
    assert deployment["max_queued_requests"] == 2 * capacity
    assert deployment["backpressure_config"] == {"status_code": 429, "retry_after_s": 1}


def test_replicas_read_the_catalog_file_as_catalog_extended_says(model_dir, tmp_path,
                                                                 ray_never_starts, capsys):
    """`xrec serve --ray --catalog FILE --catalog-extended true` (or build_app's
    `catalog_extended`) reaches each replica's engine; without --catalog it is refused."""
    from xrec.catalog import ItemCatalog

    base = ItemCatalog.from_model_dir(model_dir, 64)
    ids = base.item_ids.tolist()
    typed = ItemCatalog.from_arrays(ids, base.triples, 64, [f"d{i}" for i in ids], ["t"] * len(ids))
    typed.write(tmp_path / "typed.bin")
    options = bound_options({"model": str(model_dir), "catalog": str(tmp_path / "typed.bin"),
                             "catalog_extended": "true", "api_key": "k"})
    assert options.catalog_extended is True
    replica = serve_app.XrecReplica(options)
    try:
        assert replica.engine.catalog_version.is_extended
        assert replica.engine.catalog_version.content_hash == typed.content_hash()
    finally:
        replica.engine.close()
    with pytest.raises(ValueError, match="--catalog-extended: says how to read --catalog FILE"):
        ServeOptions(str(model_dir), catalog_extended=True)
    assert main(["serve", "--ray", "--model", str(model_dir), "--catalog-extended", "true"]) == 1
    assert capsys.readouterr().err.startswith("xrec serve: error: --catalog-extended: says how")

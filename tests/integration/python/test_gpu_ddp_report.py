"""The GPU DDP harness's arithmetic (bench/gpu/): percentiles of step times, ratios against dense
and PowerSGD of the same model and rate, time to dense's final accuracy; the process layout of
--local-ranks (ranks, GPUs, the daemons' --local-clients) without a GPU. No processes, no root."""
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))

import ddp_capped  # noqa: E402
import ddp_trainer  # noqa: E402


def test_percentiles_interpolate_like_numpy():
    s = ddp_trainer.stats_ms([0.001 * x for x in (5, 1, 4, 2, 3)])  # seconds in, ms out
    assert s["median"] == 3.0 and s["n"] == 5
    assert abs(s["p10"] - 1.4) < 1e-9 and abs(s["p90"] - 4.6) < 1e-9
    assert ddp_trainer.stats_ms([]) is None


def test_ratios_are_per_model_and_rate():
    runs = [
        {"model": "mlp50", "rate": "1gbit", "method": "dense", "step_ms": {"median": 100.0}},
        {"model": "mlp50", "rate": "1gbit", "method": "powersgd", "step_ms": {"median": 20.0}},
        {"model": "mlp50", "rate": "1gbit", "method": "sparsecar", "step_ms": {"median": 10.0}},
        {"model": "mlp50", "rate": "none", "method": "sparsecar", "step_ms": {"median": 8.0}},
        {"model": "mlp50", "rate": "none", "method": "dense", "step_ms": {"median": 4.0}},
        {"model": "resnet18", "rate": "1gbit", "method": "sparsecar", "status": "failed"},
    ]
    ddp_capped.add_ratios(runs)
    assert runs[2]["ratio_to_dense"] == 0.1 and runs[2]["ratio_to_powersgd"] == 0.5
    assert runs[3]["ratio_to_dense"] == 2.0 and runs[3]["ratio_to_powersgd"] is None  # no PowerSGD there
    assert "ratio_to_dense" not in runs[5]


def test_time_to_dense_final_accuracy():
    def run(method, curve):
        return {"model": "fmnist_cnn", "rate": "1gbit", "method": method, "status": "ok", "curve": curve,
                "final_accuracy": curve[-1][2], "train_seconds": curve[-1][1], "step_ms": {"median": 1.0}}
    runs = [run("dense", [[50, 10.0, 0.80], [100, 20.0, 0.90]]),
            run("sparsecar", [[50, 2.0, 0.85], [100, 4.0, 0.905]]),
            run("powersgd", [[50, 3.0, 0.70], [100, 6.0, 0.89]])]
    t = ddp_capped.tta_summary(runs)
    assert t["target_accuracy"] == 0.90
    assert t["methods"]["dense"]["time_to_target_s"] == 20.0
    assert t["methods"]["sparsecar"]["time_to_target_s"] == 4.0
    assert abs(t["methods"]["sparsecar"]["time_to_target_over_dense"] - 0.2) < 1e-12
    assert t["methods"]["powersgd"]["time_to_target_s"] is None  # never reached 0.90
    assert abs(t["methods"]["powersgd"]["final_accuracy_minus_dense_pp"] + 1.0) < 1e-9


def test_compressed_methods_may_run_longer_and_are_also_read_at_dense_steps():
    def run(method, curve, model="fmnist_resnet"):
        return {"model": model, "rate": "1gbit", "method": method, "status": "ok", "curve": curve,
                "steps": curve[-1][0], "final_accuracy": curve[-1][2], "train_seconds": curve[-1][1],
                "step_ms": {"median": 1.0}}
    runs = [run("dense", [[50, 10.0, 0.80], [100, 20.0, 0.90]]),
            run("sparsecar", [[50, 1.0, 0.78], [100, 2.0, 0.88], [150, 3.0, 0.91], [200, 4.0, 0.92]])]
    t = ddp_capped.tta_summary(runs)
    assert t["model"] == "fmnist_resnet" and t["dense_steps"] == 100
    sc = t["methods"]["sparsecar"]
    assert sc["accuracy_at_dense_steps"] == 0.88  # the last evaluation at or before dense's 100 steps
    assert sc["time_to_target_s"] == 3.0 and sc["steps_to_target"] == 150
    assert abs(sc["time_to_target_over_dense"] - 0.15) < 1e-12
    args = ddp_capped.parse(["--part", "tta", "--tta-model", "fmnist_resnet", "--tta-epochs", "2",
                             "--tta-epochs-compressed", "5", "--tta-dense-iterations", "50"])
    dense_argv = ddp_capped.trainer_args(args, "fmnist_resnet", "dense")
    sc_argv = ddp_capped.trainer_args(args, "fmnist_resnet", "sparsecar")
    assert dense_argv[dense_argv.index("--epochs") + 1] == "2.0" and "--dense-iterations" not in dense_argv
    assert sc_argv[sc_argv.index("--epochs") + 1] == "5.0"
    assert sc_argv[sc_argv.index("--dense-iterations") + 1] == "50"


class _Link:
    def __init__(self, capped):
        self.capped = capped
        self.rate = "1gbit" if capped else "none"

    def addr(self, node):
        return f"10.9.0.{node + 1}"

    def dev(self, node):
        return f"veth{node}"

    def argv(self, node, argv):
        return ["netns", str(node)] + list(argv)


class _Job:
    sockets = ["/tmp/n0.sock", "/tmp/n1.sock"]

    def __init__(self):
        self.daemons = []

    def daemon_env(self):
        return {"PATH": "/usr/bin"}

    def spawn(self, name, argv, env=None, log_name=None):
        return (name, argv, env)

    def wait_for_sockets(self, timeout):
        pass


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_local_ranks_layout_on_gpus():
    args = ddp_capped.parse(["--local-ranks", "2"])
    assert args.gpus == ["0", "1", "2", "3"]
    assert ddp_capped.node_gpus(args, 0) == ["0", "1"] and ddp_capped.node_gpus(args, 1) == ["2", "3"]
    assert ddp_capped.processes(args) == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    capped, uncapped = _Link(True), _Link(False)
    env = ddp_capped.trainer_env(args, _Job(), capped, 1, 1, 29500)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SPARSECAR_NODE_RANK",
                                "SPARSECAR_NNODES", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "MASTER_ADDR")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "SPARSECAR_NODE_RANK": "1",
        "SPARSECAR_NNODES": "2", "CUDA_VISIBLE_DEVICES": "3", "NCCL_SOCKET_IFNAME": "veth1",
        "MASTER_ADDR": "10.9.0.1"}
    assert ddp_capped.gpu_index(args, capped, 1, 1) == "0"  # its only visible GPU
    env = ddp_capped.trainer_env(args, _Job(), uncapped, 1, 0, 29500)
    assert env["RANK"] == "2" and "CUDA_VISIBLE_DEVICES" not in env and "NCCL_SOCKET_IFNAME" not in env
    assert ddp_capped.gpu_index(args, uncapped, 1, 0) == "2"  # every GPU visible: --gpus[rank]
    job = _Job()
    ddp_capped.start_daemons(args, job, capped, [])
    assert [_flag(argv, "--local-clients") for _, argv, _ in job.daemons] == ["2", "2"]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, _, env in job.daemons] == ["0,1", "2,3"]
    # --gpus in another order: node 0 takes the first two
    args = ddp_capped.parse(["--local-ranks", "2", "--gpus", "3,2,1,0"])
    assert ddp_capped.trainer_env(args, _Job(), capped, 0, 1, 1)["CUDA_VISIBLE_DEVICES"] == "2"
    job = _Job()
    ddp_capped.start_daemons(args, job, capped, [])
    assert [env["CUDA_VISIBLE_DEVICES"] for _, _, env in job.daemons] == ["3,2", "1,0"]


def test_one_local_rank_is_the_old_layout():
    args = ddp_capped.parse([])
    assert args.local_ranks == 1 and args.gpus == ["0", "1"]
    capped = _Link(True)
    env = ddp_capped.trainer_env(args, _Job(), capped, 1, 0, 29500)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) == ("1", "2", "0", "1")
    assert ddp_capped.gpu_index(args, capped, 1, 0) == "0"
    assert ddp_capped.gpu_index(args, _Link(False), 1, 0) == "1"


def test_gpus_must_match_the_local_ranks(capsys):
    for argv in (["--local-ranks", "2", "--gpus", "0,1"], ["--gpus", "0,0"], ["--local-ranks", "0"]):
        with pytest.raises(SystemExit):
            ddp_capped.parse(argv)
    capsys.readouterr()


def test_daemon_local_clients_from_its_log(tmp_path):
    log = tmp_path / "sparsecard-0.log"
    log.write_text("... session_server.cc:187 session server listening on /tmp/x/node-0.sock (2 local clients)\n"
                   "... client 1 (pid 7) connected (uid 0, 1 of 2 local clients)\n"
                   "... client 2 (pid 8) connected (uid 0, 2 of 2 local clients)\n"
                   "... client 1 (pid 7) disconnected: closed the connection\n")
    assert ddp_capped.daemon_local_clients(str(log)) == {"expected": 2, "connected": 2}
    log.write_text("... session server listening on /tmp/x/node-0.sock (2 local clients)\n")
    assert ddp_capped.daemon_local_clients(str(log)) == {"expected": 2, "connected": 0}
    assert ddp_capped.daemon_local_clients(str(tmp_path / "missing.log")) is None

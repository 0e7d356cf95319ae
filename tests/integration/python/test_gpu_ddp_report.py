"""The GPU DDP harness's arithmetic (bench/gpu/): percentiles of step times, ratios against dense
and PowerSGD of the same model and rate, time to dense's final accuracy. No processes, no root."""
import os
import sys

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

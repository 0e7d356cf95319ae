"""The real controllers bench's data (bench/convergence/ddp_digits.py load_shard): every rank's
shard of the training set, the held-out test set and the inputs' scaling, for both datasets,
checked against the files themselves. numpy only (no torch, no daemon, no root); seconds."""
import argparse
import os
import sys

import numpy as np
import pytest

from conftest import BENCH

sys.path.insert(0, BENCH)

import ddp_digits  # noqa: E402


def shards(dataset, world, **extra):
    args = argparse.Namespace(dataset=dataset, seed=3, digits=None, data_dir=ddp_digits.FMNIST_DIR,
                              test_limit=0, **extra)
    return [ddp_digits.load_shard(args, rank, world, np) for rank in range(world)]


def rows(x):
    return {r.tobytes() for r in x}


def test_digits_shards_partition_the_three_quarters_that_are_not_the_test_set():
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    got = shards("digits", 4)
    train = np.concatenate([s[0][0] for s in got])
    test_x, test_y = got[0][1]
    assert len(test_y) == len(y) // 4 and all(np.array_equal(s[1][0], test_x) for s in got)
    assert len(train) + len(test_x) == len(y)                       # every image exactly once
    assert len(rows(train) & rows(test_x)) <= len(y) - len(rows(x))  # shared rows only where the data repeats
    assert train.dtype == np.float32 and train.min() >= 0 and train.max() <= 1  # pixels 0..16 / 16
    assert sorted(np.concatenate([s[0][1] for s in got]).tolist() + test_y.tolist()) == sorted(y.tolist())


@pytest.mark.skipif(not os.path.isdir(ddp_digits.FMNIST_DIR), reason="dataset-fashion-mnist is not installed")
def test_fmnist_shards_partition_the_60000_training_images_and_keep_the_test_set_apart():
    got = shards("fmnist", 4)
    sizes = [len(s[0][1]) for s in got]
    assert sum(sizes) == 60000 and max(sizes) - min(sizes) <= 1
    train_x = np.concatenate([s[0][0] for s in got])
    test_x, test_y = got[0][1]
    assert train_x.shape[1] == 784 and len(test_y) == 10000
    # Standardised with the training set's pixel statistics: mean 0 and std 1 over all of it.
    assert abs(float(train_x.mean(dtype=np.float64))) < 1e-3
    assert abs(float(train_x.std(dtype=np.float64)) - 1) < 1e-3
    # Ten classes of 6,000 training images and 1,000 test images each (the dataset's split).
    labels = np.concatenate([s[0][1] for s in got])
    assert np.bincount(labels).tolist() == [6000] * 10 and np.bincount(test_y).tolist() == [1000] * 10
    args = argparse.Namespace(dataset="fmnist", seed=3, digits=None, data_dir=ddp_digits.FMNIST_DIR, test_limit=500)
    (_, _), (tx, ty) = ddp_digits.load_shard(args, 1, 4, np)
    assert len(ty) == 500 and np.array_equal(tx, test_x[:500])


def test_fmnist_missing_files_name_the_package():
    args = argparse.Namespace(dataset="fmnist", seed=1, digits=None, data_dir="/nonexistent", test_limit=0)
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        ddp_digits.load_shard(args, 0, 1, np)

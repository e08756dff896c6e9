import os

import numpy as np
import pytest
from PIL import Image

from trainer_pkg.config import ConfigError, DataConfig
from trainer_pkg.datasets import check_dataset, load_dataset


# -- digits ----------------------------------------------------------------------------------------


def test_digits_shapes_range_and_split():
    ds = load_dataset(DataConfig(), seed=0)
    assert ds.x_train.shape == (1438, 1, 8, 8) and ds.x_val.shape == (359, 1, 8, 8)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0
    assert ds.num_classes == 10 and ds.input_shape == (1, 8, 8)
    assert set(np.unique(ds.y_val)) == set(range(10))


def test_digits_are_scikit_learns_read_without_importing_it():
    """The trainer reads scikit-learn's digits file itself (no sklearn/SciPy import in every rank):
    the same values, in the same order, as ``sklearn.datasets.load_digits``."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from trainer_pkg.datasets import _load_digits

    x, y = _load_digits()
    bunch = load_digits()
    assert np.array_equal(x.reshape(1797, 64), bunch.data.astype(np.float32) / 16.0)
    assert np.array_equal(y, bunch.target) and y.dtype == np.int64
    probe = ("import sys; from trainer_pkg.datasets import _load_digits; x, y = _load_digits(); "
             "print(x.shape, int(y.sum()), sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == f"(1797, 1, 8, 8) {int(bunch.target.sum())} []"


def test_digits_split_is_seeded():
    a, b, c = (load_dataset(DataConfig(), seed=s) for s in (0, 0, 1))
    assert np.array_equal(a.x_val, b.x_val) and np.array_equal(a.y_train, b.y_train)
    assert not np.array_equal(a.y_val, c.y_val)
    # the split is a partition: together the two halves are the whole dataset, sorted the same
    whole = np.sort(np.concatenate([a.x_train, a.x_val]).reshape(1797, -1), axis=0)
    assert np.array_equal(whole, np.sort(np.concatenate([c.x_train, c.x_val]).reshape(1797, -1), axis=0))


def test_val_fraction_is_respected():
    ds = load_dataset(DataConfig(val_fraction=0.5), seed=0)
    assert len(ds.y_val) == round(1797 * 0.5) and len(ds.y_train) == 1797 - round(1797 * 0.5)


# -- ImageFolder ------------------------------------------------------------------------------------


def _image_tree(root, classes=("cat", "dog", "eel"), per_class=4, size=(10, 6)):
    for ci, name in enumerate(classes):
        os.makedirs(root / name)
        for i in range(per_class):
            color = (ci * 100, i * 40, 255 - ci * 100)
            Image.new("RGB" if i % 2 else "L", size, color if i % 2 else ci * 100).save(root / name / f"{i}.png")
    return root


def test_imagefolder_loads_resized_rgb(tmp_path):
    root = _image_tree(tmp_path / "imgs")
    ds = load_dataset(DataConfig(format="imagefolder", uri=str(root), image_size=12, val_fraction=0.25), seed=0)
    assert ds.x_train.shape == (9, 3, 12, 12) and ds.x_val.shape == (3, 3, 12, 12)
    assert ds.num_classes == 3 and ds.input_shape == (3, 12, 12)
    # class ids follow the sorted folder names; the "dog" (id 1) RGB images are (100, 40·i, 155)
    x = np.concatenate([ds.x_train, ds.x_val])
    y = np.concatenate([ds.y_train, ds.y_val])
    assert sorted(y.tolist()) == [0] * 4 + [1] * 4 + [2] * 4
    dog_rgb = x[(y == 1) & (x[:, 0, 0, 0] != x[:, 2, 0, 0])]
    assert np.allclose(dog_rgb[:, 0], 100 / 255) and np.allclose(dog_rgb[:, 2], 155 / 255)


def test_imagefolder_train_val_folders_are_the_split(tmp_path):
    _image_tree(tmp_path / "d" / "train", per_class=3)
    _image_tree(tmp_path / "d" / "val", per_class=1)
    ds = load_dataset(DataConfig(format="imagefolder", uri=str(tmp_path / "d"), image_size=8), seed=0)
    assert len(ds.y_train) == 9 and sorted(ds.y_val.tolist()) == [0, 1, 2]


def test_imagefolder_check_and_errors(tmp_path):
    root = _image_tree(tmp_path / "imgs")
    assert check_dataset("imagefolder", str(root)) == "12 images, 3 classes (cat, dog, eel)"
    os.makedirs(root / "fox")
    with pytest.raises(ConfigError, match=r"class folder .*/fox has no images"):
        check_dataset("imagefolder", str(root))
    (root / "fox" / "0.png").write_bytes(b"not a png")
    with pytest.raises(ConfigError, match=r"image .*/fox/0.png cannot be read"):
        check_dataset("imagefolder", str(root))
    with pytest.raises(ConfigError, match="has no class sub-folders"):
        check_dataset("imagefolder", str(root / "cat"))


# -- CSV ----------------------------------------------------------------------------------------------


def _csv(path, rows, header="a,b,label"):
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return path


def test_csv_loads_features_and_labels(tmp_path):
    path = _csv(tmp_path / "t.csv", [f"{i},{i * 0.5},{i % 3}" for i in range(10)])
    ds = load_dataset(DataConfig(format="csv", uri=str(path), val_fraction=0.2), seed=0)
    assert ds.x_train.shape == (8, 2) and ds.x_val.shape == (2, 2)
    assert ds.num_classes == 3 and ds.input_shape == (2,)
    x = np.concatenate([ds.x_train, ds.x_val])
    y = np.concatenate([ds.y_train, ds.y_val])
    assert np.array_equal(x[:, 1], x[:, 0] * 0.5) and np.array_equal(y, x[:, 0].astype(int) % 3)
    assert check_dataset("csv", str(path)) == "10 samples, 3 classes, 2 features"


def test_csv_label_column_can_be_anywhere(tmp_path):
    path = _csv(tmp_path / "t.csv", ["1,0.5,2", "0,1.5,3"], header="y,f1,f2")
    assert check_dataset("csv", str(path), label_column="y") == "2 samples, 2 classes, 2 features"


def test_csv_without_label_column(tmp_path):
    path = _csv(tmp_path / "t.csv", ["1,2"], header="a,b")
    with pytest.raises(ConfigError) as err:
        check_dataset("csv", str(path))
    assert str(err.value).startswith(f"CSV {path} has no column 'label' (columns: a, b)")


@pytest.mark.parametrize(
    "rows, message",
    [
        (["1,2,x"], "line 2, column 'label': 'x' is not a number"),
        (["1,2,1.5"], "line 2: label '1.5' in column 'label' must be an integer class id"),
        (["1,2,0", "1,2"], "line 3 has 2 fields, the header has 3"),
        ([], "has a header but no data rows"),
    ],
)
def test_csv_content_errors(tmp_path, rows, message):
    path = _csv(tmp_path / "t.csv", rows)
    with pytest.raises(ConfigError, match=message):
        check_dataset("csv", str(path))


# -- NPZ ---------------------------------------------------------------------------------------------


def test_npz_with_and_without_validation_arrays(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(20, 6, 6), dtype=np.uint8)
    y = np.arange(20) % 4
    np.savez(tmp_path / "a.npz", x_train=x, y_train=y)
    ds = load_dataset(DataConfig(format="npz", uri=str(tmp_path / "a.npz"), val_fraction=0.25), seed=1)
    assert ds.x_train.shape == (15, 1, 6, 6) and ds.x_val.shape == (5, 1, 6, 6)
    assert ds.x_train[:].max() <= 1.0 and ds.num_classes == 4
    assert check_dataset("npz", str(tmp_path / "a.npz")) == "20 samples, 4 classes, inputs 1×6×6"

    np.savez_compressed(tmp_path / "b.npz", x_train=rng.normal(size=(8, 3)), y_train=np.arange(8) % 2,
                        x_val=rng.normal(size=(4, 3)), y_val=np.array([0, 1, 2, 1]))
    ds = load_dataset(DataConfig(format="npz", uri=str(tmp_path / "b.npz")), seed=0)
    assert ds.x_train.shape == (8, 3) and ds.x_val.shape == (4, 3) and ds.num_classes == 3
    assert ds.y_val.tolist() == [0, 1, 2, 1]  # an explicit split is used as given
    assert check_dataset("npz", str(tmp_path / "b.npz")) == "12 samples, 3 classes, 3 features"


def test_npz_without_x_train(tmp_path):
    np.savez(tmp_path / "bad.npz", features=np.zeros((3, 2)), y_train=np.zeros(3, dtype=int))
    with pytest.raises(ConfigError) as err:
        check_dataset("npz", str(tmp_path / "bad.npz"))
    assert f"NPZ {tmp_path / 'bad.npz'} has no x_train (arrays: features, y_train)" in str(err.value)
    assert "numpy.savez(path, x_train=" in str(err.value)


def test_npz_errors(tmp_path):
    np.savez(tmp_path / "n.npz", x_train=np.zeros((3, 2)), y_train=np.zeros(4, dtype=int))
    with pytest.raises(ConfigError, match="x_train has 3 samples but y_train has 4"):
        check_dataset("npz", str(tmp_path / "n.npz"))
    (tmp_path / "z.npz").write_text("hello")
    with pytest.raises(ConfigError, match="is not a readable .npz archive"):
        check_dataset("npz", str(tmp_path / "z.npz"))


# -- paths ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["csv", "npz", "imagefolder"])
def test_missing_path(tmp_path, fmt):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError) as err:
        check_dataset(fmt, str(missing))
    assert str(err.value) == f"{fmt} dataset path {missing} does not exist: check the path or upload the data there"


def test_unreadable_and_wrong_kind_paths(tmp_path):
    path = _csv(tmp_path / "t.csv", ["1,2,0"])
    with pytest.raises(ConfigError, match="is a folder: give the path of the .csv file itself"):
        check_dataset("csv", str(tmp_path))
    with pytest.raises(ConfigError, match="imagefolder dataset .* is a file"):
        check_dataset("imagefolder", str(path))
    with pytest.raises(ConfigError, match="is not a local path"):
        check_dataset("csv", "s3://bucket/t.csv")
    if os.geteuid() != 0:  # root reads everything
        path.chmod(0)
        with pytest.raises(ConfigError, match="is not readable by this process"):
            check_dataset("csv", str(path))


def test_builtin_digits_summary():
    assert check_dataset("builtin", "digits") == "1,797 samples, 10 classes, inputs 1×8×8"
    with pytest.raises(ConfigError, match="unknown built-in dataset 'mnist'"):
        check_dataset("builtin", "mnist")

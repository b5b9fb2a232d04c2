"""The example alerting rules for the pipeline's health load in Prometheus's own checker, and
fire on the series the pipeline serves at /metrics (``promtool test rules``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

INFRA = Path(__file__).resolve().parents[2] / "infra"
RULES = INFRA / "prometheus" / "trainscope-pipeline-rules.yml"

UNIT_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'trainscope_alertmanager_posts_failed_total{{instance="p:9464"}}'
        values: '0+3x20'
      - series: 'trainscope_pipeline_windows_closed_total{{instance="p:9464"}}'
        values: '0+4x30'
      - series: 'trainscope_pipeline_commits_total{{instance="p:9464"}}'
        values: '5x30'
      - series: >-
          trainscope_pipeline_detector_seconds_total{{instance="p:9464",detector="peer-diff"}}
        values: '0+0.4x30'
      - series: 'trainscope_pipeline_sink_windows_dropped_total{{instance="p:9464"}}'
        values: '0x30'
    alert_rule_test:
      - eval_time: 20m
        alertname: TrainscopeAlertmanagerUnreachable
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "p:9464"}}
            exp_annotations:
              summary: "trainscope pipeline p:9464 cannot deliver findings to Alertmanager"
      - eval_time: 20m
        alertname: TrainscopePipelineNotCommitting
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "p:9464"}}
            exp_annotations:
              summary: "trainscope pipeline p:9464 has not committed in 15 minutes"
      - eval_time: 20m
        alertname: TrainscopeDetectorsSlow
        exp_alerts: []
      - eval_time: 20m
        alertname: TrainscopePipelineSinkFailing
        exp_alerts: []
"""


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        reason = "promtool is not installed (infra/setup-test-host.sh installs prometheus)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def test_the_rules_load_and_fire_on_the_pipelines_series(tmp_path: Path) -> None:
    tool = promtool()
    checked = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True,
                             text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tests = tmp_path / "rules_test.yml"
    tests.write_text(UNIT_TESTS.format(rules=RULES))
    done = subprocess.run([tool, "test", "rules", str(tests)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr

"""JUnit XML for CI (Buildkite's test analytics, GitHub Actions' test reporters, Jenkins): stdlib only.

The common dialect: <testsuites> of <testsuite> of <testcase>, each passed or with one <failure>,
<error> or <skipped>; `system-out` carries a log tail. Text is stripped of what XML 1.0 cannot hold
(ANSI escapes, control characters), since campaign logs contain both.
"""

from __future__ import annotations

import re
import socket
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass(frozen=True)
class JUnitCase:
    name: str
    outcome: str  # passed | failed | error | skipped
    seconds: float = 0.0
    message: str = ""  # one line: the failure's title, the skip's reason
    details: str = ""  # the failure's or error's body (repro path, log tail)
    stdout: str = ""  # for passed cases too (a known bug still present, good news)

    def __post_init__(self):
        if self.outcome not in OUTCOMES:
            raise ValueError(f"JUnitCase {self.name!r}: outcome {self.outcome!r} is not one of {', '.join(OUTCOMES)}")


@dataclass(frozen=True)
class JUnitSuite:
    name: str
    cases: list[JUnitCase]
    properties: dict[str, str] = field(default_factory=dict)

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.cases)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(text: str) -> str:
    return _NOT_XML.sub("?", _ANSI.sub("", text))


def _counts(el: ET.Element, suites: list[JUnitSuite]) -> None:
    el.set("tests", str(sum(len(s.cases) for s in suites)))
    el.set("failures", str(sum(s.count("failed") for s in suites)))
    el.set("errors", str(sum(s.count("error") for s in suites)))
    el.set("skipped", str(sum(s.count("skipped") for s in suites)))
    el.set("time", f"{sum(s.seconds for s in suites):.3f}")


def junit_xml(suites: list[JUnitSuite], name: str) -> ET.ElementTree:
    root = ET.Element("testsuites", name=name)
    _counts(root, suites)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    for suite in suites:
        s = ET.SubElement(root, "testsuite", name=suite.name, timestamp=stamp, hostname=socket.gethostname())
        _counts(s, [suite])
        if suite.properties:
            props = ET.SubElement(s, "properties")
            for k, v in suite.properties.items():
                ET.SubElement(props, "property", name=k, value=xml_text(str(v)))
        for case in suite.cases:
            c = ET.SubElement(s, "testcase", classname=f"{name}.{suite.name}", name=xml_text(case.name),
                              time=f"{case.seconds:.3f}")
            if case.outcome != "passed":
                tag = {"failed": "failure", "error": "error", "skipped": "skipped"}[case.outcome]
                el = ET.SubElement(c, tag, message=xml_text(case.message))
                if case.outcome != "skipped":
                    el.set("type", tag)
                    el.text = xml_text(case.details or case.message)
            if case.stdout:
                ET.SubElement(c, "system-out").text = xml_text(case.stdout)
    ET.indent(root)
    return ET.ElementTree(root)


def write_junit(suites: list[JUnitSuite], path: Path, name: str = "attnfuzz") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    junit_xml(suites, name).write(path, encoding="utf-8", xml_declaration=True)
    return path

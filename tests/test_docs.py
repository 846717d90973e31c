"""The documentation's links and file references resolve, and the pages speak to users: no path of the machine
that measured a figure, no account of how the work went."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(['README.md', 'DEVELOPERS.md'] + [os.path.relpath(p, ROOT) for p in
                                                 glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True)])
LINK = re.compile(r'\]\(([^)\s]+)\)')
# A file of the project named in the text (not a pattern: names with *, { or < are skipped).
REFERENCE = re.compile(r'(?<![\w/.])((?:fedjax_het|experiments|benchmarks|tests|docs|examples)/[\w/.\-]+\.'
                       r'(?:py|md|flags|png|ipynb|json))\b')
MACHINE_PATH = re.compile(r'/(?:work|root|home/\w+)/')
WORK_HISTORY = re.compile(r'\b(?:issue \d+|stop \d+|this session|previous session|before this change)\b', re.I)


def broken_references(page: str, text: str) -> list[str]:
  """The relative links of `text` (a page at `page`) and the project files it names that do not exist."""
  here = os.path.dirname(os.path.join(ROOT, page))
  broken = []
  for target in LINK.findall(text):
    if re.match(r'[a-z]+:', target) or target.startswith('#'):
      continue
    if not os.path.exists(os.path.join(here, target.split('#')[0])):
      broken.append(target)
  for path in REFERENCE.findall(text):
    if not any(c in path for c in '*{<') and not os.path.exists(os.path.join(ROOT, path)):
      broken.append(path)
  return sorted(set(broken))


def test_a_broken_link_and_a_missing_file_are_found():
  text = '[a](docs/no_such.md), [b](README.md), [c](https://x.org), see fedjax_het/no_such.py and fedjax_het/core.py'
  assert broken_references('README.md', text) == ['docs/no_such.md', 'fedjax_het/no_such.py']


@pytest.mark.parametrize('page', PAGES)
def test_every_link_and_referenced_file_exists(page):
  with open(os.path.join(ROOT, page)) as f:
    assert broken_references(page, f.read()) == []


@pytest.mark.parametrize('page', PAGES)
def test_pages_name_no_machine_path_and_no_work_history(page):
  with open(os.path.join(ROOT, page)) as f:
    text = f.read()
  assert MACHINE_PATH.findall(text) == [] and WORK_HISTORY.findall(text) == []


def test_the_readme_is_a_front_door():
  with open(os.path.join(ROOT, 'README.md')) as f:
    assert len(f.read().splitlines()) <= 250

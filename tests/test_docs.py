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
WORK_HISTORY = re.compile(r'\b(?:issue \d+|stop \d+|this session|previous session|before this change|'
                          r'(?<!is )(?<!are )(?<!be )(?<!was )used to (?!\w+ing)\w+)\b', re.I)
# The machine the writer happened to use, where a figure should name its hardware.
WRITERS_MACHINE = re.compile(r'\bthis (?:machine|CPU|GPU|host|computer|laptop|\d+-core)\b|\b(?:installs|measured|run|'
                             r'made|read) here\b', re.I)


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


FENCE = re.compile(r'^(```|~~~).*?^\1', re.M | re.S)
HEADING = re.compile(r'^#{1,6}[ \t]+(.+?)[ \t#]*$', re.M)


def github_slug(heading: str) -> str:
  """The anchor GitHub gives a heading: its rendered text (a link's text, code without backticks, no emphasis
  marks) lower-cased, every character but letters, digits, '_', '-' and spaces dropped, each space a '-'."""
  text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading)
  text = re.sub(r'<[^>]+>', '', text)
  return re.sub(r'[^\w\- ]', '', text.strip().lower()).replace(' ', '-')


def anchors(text: str) -> set[str]:
  """The anchors of a Markdown page's headings (outside code blocks), a repeated one numbered -1, -2, ... as
  GitHub numbers them."""
  seen, found = {}, set()
  for heading in HEADING.findall(FENCE.sub('', text)):
    slug = github_slug(heading)
    found.add(slug if slug not in seen else f'{slug}-{seen[slug]}')
    seen[slug] = seen.get(slug, 0) + 1
  return found


def broken_anchors(page: str, text: str) -> list[str]:
  """The links of `text` (a page at `page`) to a heading, '#anchor' or 'page.md#anchor', that no heading of
  that page has."""
  here = os.path.dirname(os.path.join(ROOT, page))
  broken = []
  for target in LINK.findall(text):
    if re.match(r'[a-z]+:', target) or '#' not in target:
      continue
    path, anchor = target.split('#', 1)
    file = os.path.join(here, path) if path else os.path.join(ROOT, page)
    if not file.endswith('.md') or not os.path.exists(file):
      continue  # a missing file is `broken_references`'s finding
    with open(file) as f:
      if anchor not in anchors(f.read()):
        broken.append(target)
  return sorted(set(broken))


def test_github_slugs_and_a_broken_anchor_are_found():
  assert github_slug("FedMD, FedDF and `pFedAFM`: the seed tables' baselines") == (
      'fedmd-feddf-and-pfedafm-the-seed-tables-baselines')
  assert github_slug('On a GPU: the H100 sweep') == 'on-a-gpu-the-h100-sweep'
  assert github_slug('GeFL-F (the [paper](x.md))  and 8x8') == 'gefl-f-the-paper--and-8x8'
  assert anchors('# A\n```\n# not a heading\n```\n## A\n### b_c\n') == {'a', 'a-1', 'b_c'}
  assert broken_anchors('docs/usage.md', '[a](#no-such-heading) [b](../README.md#install) '
                        '[c](../README.md#instal) [d](design.md)') == ['#no-such-heading', '../README.md#instal']


@pytest.mark.parametrize('page', PAGES)
def test_every_anchor_names_a_heading(page):
  with open(os.path.join(ROOT, page)) as f:
    assert broken_anchors(page, f.read()) == []


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
  assert WRITERS_MACHINE.findall(text) == []


def test_the_writers_machine_and_history_are_found():
  text = ('measured on this CPU; Ray, which installs here; on this 2-core CPU; a half-written one used to crash '
          'every run; the mask is used to pick rows; this machine')
  assert WRITERS_MACHINE.findall(text) == ['this CPU', 'installs here', 'this 2-core', 'this machine']
  assert WORK_HISTORY.findall(text) == ['used to crash']


def test_the_readme_is_a_front_door():
  with open(os.path.join(ROOT, 'README.md')) as f:
    assert len(f.read().splitlines()) <= 250


# What a user's clone does not have: folders beside the checkout, the papers' text files, spec pages; and what
# only the project's own build process knows (its CI script, time targets set for developers).
OUTSIDE = re.compile(r'\.\./shared|\bshared/(?:papers|fixtures|measurements)|\bSPEC(?:_GENERATIVE)?\.md\b|'
                     r'\b(?:fedre|fedvtc_iclr|fedvtc_arxiv|gefl|felo_velo)\.txt\b')
BUILD_PROCESS = re.compile(r'\.ci/run|\bCI\b|target is \d+ minutes|the limit \d+|suite budget', re.I)
USER_TEXTS = sorted(['README.md'] + [os.path.relpath(p, ROOT) for p in
                                     glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True)])
TEST_FILES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'tests', '*.py')))


def outside_references(text: str) -> list[str]:
  """The references of `text` to what lies outside the repository."""
  return OUTSIDE.findall(text)


def escaping_links(page: str, text: str) -> list[str]:
  """The relative links of `text` (a page at `page`) that point outside the repository."""
  here = os.path.dirname(os.path.join(ROOT, page))
  return [t for t in LINK.findall(text) if not re.match(r'[a-z]+:', t) and not t.startswith('#')
          and not os.path.abspath(os.path.join(here, t.split('#')[0])).startswith(ROOT + os.sep)]


def test_outside_references_and_the_build_process_are_found():
  beside, spec = '..' + '/shared', 'SPEC' + '.md'  # spelled in two pieces: this file names no such path itself
  assert outside_references(f"read('{beside}/fixtures/x.json'); see {spec} and gefl.txt Eq. 1") == [
      beside, spec, 'gefl.txt']
  assert escaping_links('docs/usage.md', f'[a](../README.md), [b](../{beside}/x.md)') == [f'../{beside}/x.md']
  assert BUILD_PROCESS.findall('`time bash .ci/run`: the target is 10 minutes, the limit 15') == [
      '.ci/run', 'target is 10 minutes', 'the limit 15']
  assert outside_references('an entry in tests/fixtures/htfllib_partitions.json') == []


@pytest.mark.parametrize('path', USER_TEXTS + TEST_FILES + ['DEVELOPERS.md'])
def test_nothing_points_outside_the_repository(path):
  """README, DEVELOPERS.md, docs/ and tests/ need nothing beside the checkout (fixtures live in tests/fixtures/,
  papers are cited by title, section and equation)."""
  with open(os.path.join(ROOT, path)) as f:
    text = f.read()
  if path.endswith('.py') and os.path.basename(path) == 'test_docs.py':
    text = text.split('# What a user', 1)[0]  # this file's own patterns and examples
  assert outside_references(text) == [] and escaping_links(path, text) == []
  if path.endswith('.py'):
    assert not re.search(r"'\.\.',\s*'\.\.'", text), path  # a path two levels up: beside the checkout


@pytest.mark.parametrize('page', USER_TEXTS)
def test_user_pages_say_nothing_of_the_build_process(page):
  with open(os.path.join(ROOT, page)) as f:
    assert BUILD_PROCESS.findall(f.read()) == []


def documented_records(text: str) -> dict[str, tuple[str, list[str]]]:
  """design.md's records table: record -> (module under fedjax_het, fields)."""
  rows = re.findall(r'^\| `(\w+)` \| `([\w.]+)` \| ([\w, ]+) \|$', text, re.M)
  return {name: (module, [f.strip() for f in fields.split(',')]) for name, module, fields in rows}


def record_fields(module: str, name: str) -> list[str]:
  import dataclasses
  import importlib
  record = getattr(importlib.import_module(f'fedjax_het.{module}'), name)
  if hasattr(record, '_fields'):
    return list(record._fields)
  return [f.name for f in dataclasses.fields(record) if not f.name.startswith('_')]


def test_design_md_lists_every_records_fields_as_built():
  with open(os.path.join(ROOT, 'docs', 'design.md')) as f:
    records = documented_records(f.read())
  assert {'ClientState', 'ClientProgram', 'Phase', 'Algorithm', 'Uploads', 'LocalTraining', 'Method'} <= set(records)
  for name, (module, fields) in records.items():
    assert record_fields(module, name) == fields, f'docs/design.md: the fields of {name}'


def test_the_records_check_finds_a_stale_row():
  stale = documented_records('| `Batch` | `core` | x, y, index |\n')
  assert record_fields('core', 'Batch') != stale['Batch'][1]

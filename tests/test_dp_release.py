"""What a DP run keeps secret and what it releases (docs/privacy.md): the secret behind the noise, the workdir's
`.dp_secret` on resume, and rows, logs and Flower messages that carry nothing the accounting assumes hidden."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from fedjax_het.privacy.dp import gaussian_noise
from fedjax_het.run import experiment

from golden import TINY, make_golden_federation
from runs import CFG, metric_rows


# ---------------------------------------------------------------- 1. the secret behind the noise
def test_the_noise_depends_on_every_bit_of_a_128_bit_secret(monkeypatch):
  """Two secrets equal in their low 64 bits (and in their low 96) give other round keys and other noise, for the
  clients and for the server; a run's secret is 128 bits of the OS's entropy; without a secret the keys are the
  seed's as before (the golden runs)."""
  fed = make_golden_federation('fedavg')
  seeded = [np.asarray(k) for k in fed.round_keys(2)]
  noise = lambda key: np.asarray(gaussian_noise(np.zeros(16, np.float32), jax.random.fold_in(key, 0), 1.0))
  for low, shift in ((0x0123_4567, 40), (0x0123456789ABCDEF_FEDCBA98, 100)):  # equal low 32 / low 96 bits
    keys = {}
    for high in (1, 2):
      fed.secret = low | (high << shift)
      keys[high] = [np.asarray(k) for k in fed.round_keys(2)]
    for a, b in zip(keys[1], keys[2]):  # the clients' key, the server's key
      assert not np.array_equal(a, b), hex(low)
      assert not np.allclose(noise(a), noise(b))
  fed.secret = None
  assert all(np.array_equal(a, b) for a, b in zip(seeded, fed.round_keys(2)))
  asked = []
  monkeypatch.setattr(experiment.secrets, 'randbits', lambda bits: asked.append(bits) or 7)
  experiment.dp_secret(dataclasses.replace(CFG, dp_mode='local', dp_noise_multiplier=1.0))
  assert asked == [128]


# ---------------------------------------------------------------- 4. resuming needs the run's own secret
def _files(folder) -> dict:
  """Every file under `folder` (but the lock) and its bytes."""
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob('*'))
          if p.is_file() and p.name != '.lock'}


def test_a_dp_run_whose_secret_is_missing_or_unreadable_is_refused_and_left_untouched(tmp_path):
  """A resumed DP run whose `.dp_secret` is missing, empty, not a number or a folder stops with one line saying so
  and what to do, and changes nothing in its workdir (a new secret would draw other noise and participants, and
  account the rounds that ran from a draw that never happened); with the secret back it resumes."""
  from fedjax_het.errors import ConfigError
  cfg = dataclasses.replace(CFG, rounds=2, dp_mode='central', dp_noise_multiplier=1.0)
  experiment.train_and_evaluate(cfg, str(tmp_path), progress=False)
  secret = tmp_path / '.dp_secret'
  original = secret.read_text()
  assert len(original) > 30  # 128 bits in decimal

  def refused(match):
    before = _files(tmp_path)
    with pytest.raises(ConfigError, match=match) as e:
      experiment.train_and_evaluate(dataclasses.replace(cfg, rounds=3), str(tmp_path), resume=True, progress=False)
    assert '\n' not in str(e.value) and 'Fix: put back' in str(e.value), str(e.value)
    assert _files(tmp_path) == before
  secret.unlink()
  refused(r"^--resume: this DP run's secret .*\.dp_secret is missing")
  secret.write_text('')
  refused(r'\.dp_secret is empty')
  secret.write_text('not a number\n')
  refused(r'\.dp_secret holds no secret')
  secret.unlink()
  secret.mkdir()
  refused(r'\.dp_secret cannot be read \(Is a directory\)')
  secret.rmdir()
  secret.write_text(original)
  summary = experiment.train_and_evaluate(dataclasses.replace(cfg, rounds=3), str(tmp_path), resume=True,
                                          progress=False)
  assert summary['rounds'] == 3 and secret.read_text() == original


# ---------------------------------------------------------------- 3, 5. rows that keep the draw secret
def test_where_the_accounting_counts_on_a_secret_draw_no_per_client_accuracy_is_released(tmp_path):
  """Central FML, half the clients a round, amplified by the draw: a client's accuracy moves only where its own
  model trained, so per-client accuracies would name the drawn clients. The rows carry the aggregates alone, and
  summary.json's dp block says so; a method whose accounting takes the draw as public keeps them."""
  cfg = dataclasses.replace(CFG, algorithm='fml', rounds=2, dp_mode='central', dp_noise_multiplier=1.0,
                            methods={'fml': TINY['methods']['fml']})
  summary = experiment.train_and_evaluate(cfg, str(tmp_path / 'fml'), progress=False)
  rows = metric_rows(tmp_path / 'fml')
  assert summary['dp']['amplified_by_sampling'] and [r['round'] for r in rows] == [1, 2]
  assert all('accuracy' in r and 'client_accuracy_mean' in r and 'client_accuracy' not in r for r in rows)
  assert summary['dp']['evaluation'].startswith('aggregates over every client only')
  assert 'client_accuracy' in summary['dp']['withheld']
  public = dataclasses.replace(cfg, algorithm='fedavg', rounds=1)
  summary = experiment.train_and_evaluate(public, str(tmp_path / 'fedavg'), progress=False)
  assert not summary['dp']['amplified_by_sampling'] and 'client_accuracy' in metric_rows(tmp_path / 'fedavg')[-1]


def test_under_dp_no_per_round_timing_is_released_in_rows_or_tensorboard(tmp_path):
  """An amplified Poisson run (LG-FedAvg, q = 0.3: some rounds draw nobody and take a fraction of the time of the
  others): no row and no TensorBoard scalar holds a round's timing; summary.json keeps the run's total."""
  from test_experiment import tensorboard_scalars
  cfg = dataclasses.replace(CFG, algorithm='lg_fedavg', participation='poisson', join_ratio=0.3, rounds=4,
                            dp_mode='central', dp_noise_multiplier=2.0, dp_reproducible_noise=True)
  summary = experiment.train_and_evaluate(cfg, str(tmp_path), progress=False, tensorboard=True)
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert len(rows) == 4 and not [k for r in rows for k in r if k.endswith('_seconds')]
  assert not [tag for tag, _ in tensorboard_scalars(tmp_path / 'tensorboard') if tag.endswith('_seconds')]
  assert summary['seconds'] > 0 and 'per-round timings withheld' in summary['dp']['timings']


# ---------------------------------------------------------------- 2, 6. Flower under DP
@pytest.fixture(scope='module')
def flower_dp_run(tmp_path_factory):
  """A local-DP run over Flower messages delivered in process (tests/test_flower.py's grid), 2 of 4 clients a
  round, the node of a participant of round 2 silent from then on: every message and reply, the server's log lines
  and log records, the rows and the summary."""
  import logging
  from fedjax_het.flower.rounds import FlowerRounds
  from test_flower import InProcessGrid

  class Recording(InProcessGrid):
    def send_and_receive(self, messages, timeout=None):
      replies = super().send_and_receive(messages, timeout)
      self.seen.extend((m.metadata.message_type, r) for m, r in zip(messages, replies))  # one type per call
      return replies

  class Records(logging.Handler):
    def emit(self, record):
      said.append(record.getMessage())
  tmp = tmp_path_factory.mktemp('flower_dp')
  cfg = dataclasses.replace(CFG, rounds=2, dp_mode='local', dp_noise_multiplier=1.0)
  silent = int(experiment.build_federation(cfg).participants(1)[0])  # local DP: the seed's draw
  grid = Recording(str(tmp / 'nodes'), 4, silent={silent: 1})
  grid.seen, lines, said = [], [], []
  handler, root = Records(logging.INFO), logging.getLogger()
  from absl import logging as absl_logging
  level, verbosity = root.level, absl_logging.get_verbosity()
  root.addHandler(handler)
  root.setLevel(logging.INFO)
  absl_logging.set_verbosity(absl_logging.INFO)  # an entry point run earlier in this process may have lowered it
  try:
    summary = experiment.train_and_evaluate(cfg, str(tmp / 'run'), progress=False, federation=lambda fed: (
        FlowerRounds(fed, grid, json.dumps(cfg.to_dict()), round_timeout=5, connect_timeout=5, log=lines.append)))
  finally:
    root.removeHandler(handler)
    root.setLevel(level)
    absl_logging.set_verbosity(verbosity)
  with open(tmp / 'run' / 'metrics.jsonl') as f:
    text = f.read()
  return dict(cfg=cfg, silent=silent, seen=grid.seen, lines=lines, said=said, summary=summary, text=text,
              rows=[json.loads(line) for line in text.splitlines()])


def test_a_flower_dp_run_sends_and_logs_nothing_per_client_beyond_the_noised_uploads(flower_dp_run):
  """Every TRAIN reply holds the node's upload alone (no loss; beside it only the round and run token it answers,
  the server's own), no QUERY reply the size of its data, no node is asked for scores (local DP); the server's log
  lines name no client and count or time nothing; the rows hold no loss, missing client, count of evaluated nodes,
  accuracy or timing."""
  from flwr.app import MessageType
  run = flower_dp_run
  kinds = [kind for kind, _ in run['seen']]
  assert kinds.count(MessageType.TRAIN) == 3 and MessageType.EVALUATE not in kinds
  for kind, reply in run['seen']:
    if kind == MessageType.TRAIN:
      assert list(reply.content.keys()) == ['upload', 'reply']  # and the round and run token it answers
      assert set(reply.content['reply'].keys()) == {'round', 'run'}  # (the server's own, `rounds.check_binding`)
    else:
      assert set(reply.content['node'].keys()) == {'client', 'architecture'}
  assert run['lines'] == ['round 1/2: trained', 'round 1/2: no evaluation (under local DP the nodes send no scores)',
                          'round 2/2: trained', 'round 2/2: no evaluation (under local DP the nodes send no scores)']
  silent = run['silent']
  assert run['said'] and not [m for m in run['said'] if f'client {silent}' in m or 'did not answer' in m
                              or 'left out' in m]
  for row in run['rows']:
    assert not {'train_loss', 'missing_clients', 'rejected_clients', 'evaluated_clients', 'client_accuracy',
                'accuracy'} & set(row)
  assert '_seconds' not in run['text']
  assert run['summary']['finished'] and run['summary']['final_accuracy'] is None
  assert run['summary']['dp']['epsilon'] > 0



def test_a_resumed_flower_run_accounts_the_draw_that_was_made_not_the_clients_that_answered(flower_dp_run):
  """Round 2 drew 2 clients and 1 answered: the rows record the draw (`drawn`), so the accounting of a resumed run
  draws the same clients again for the rounds that ran (a draw of 1 of 4 would be another client set)."""
  run = flower_dp_run
  fed, budget = experiment.build_federation_and_budget(run['cfg'])
  assert [r['participants'] for r in run['rows']] == [2, 1] and [r['drawn'] for r in run['rows']] == [2, 2]
  resumed = budget.after(run['rows'])
  assert [resumed.schedule.participants(r).tolist() for r in range(2)] == [fed.participants(r).tolist()
                                                                            for r in range(2)]
  assert resumed.epsilon(2) == budget.epsilon(2)

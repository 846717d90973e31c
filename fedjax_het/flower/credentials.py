"""Credentials of an authenticated local deployment: a TLS certificate authority and the SuperLink's certificate
for 127.0.0.1 (Flower authenticates SuperNodes only over TLS), and one EC key pair per SuperNode, which the
SuperLink accepts once its public key is registered (`flwr supernode register`, with `--enable-supernode-auth`).
Written with the `cryptography` package Flower installs; the private keys are readable by their owner only."""

from __future__ import annotations

import datetime
import ipaddress
import os
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


class TLSFiles(NamedTuple):
  """The certificate authority's certificate (SuperNodes and the CLI verify the SuperLink with it) and the
  SuperLink's certificate and private key."""
  ca_certificate: str
  certificate: str
  private_key: str


def _write(path: str, data: bytes, private: bool = False) -> str:
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
  with os.fdopen(fd, 'wb') as f:
    f.write(data)
  return path


def _pem_key(key) -> bytes:
  return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                           serialization.NoEncryption())


def tls_files(folder: str, days: int = 30) -> TLSFiles:
  """A new certificate authority and a certificate it signs for the SuperLink at 127.0.0.1 / localhost, valid
  `days` days, written to `folder`."""
  os.makedirs(folder, exist_ok=True)
  now = datetime.datetime.now(datetime.timezone.utc)
  ca_key = ec.generate_private_key(ec.SECP384R1())
  ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, 'fedjax_het local deployment CA')])
  ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256()))
  key = ec.generate_private_key(ec.SECP384R1())
  names = x509.SubjectAlternativeName([x509.DNSName('localhost'), x509.IPAddress(ipaddress.ip_address('127.0.0.1'))])
  certificate = (x509.CertificateBuilder()
                 .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, 'localhost')]))
                 .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                 .not_valid_before(now - datetime.timedelta(minutes=5))
                 .not_valid_after(now + datetime.timedelta(days=days))
                 .add_extension(names, critical=False).sign(ca_key, hashes.SHA256()))
  return TLSFiles(_write(os.path.join(folder, 'ca.crt'), ca.public_bytes(serialization.Encoding.PEM)),
                  _write(os.path.join(folder, 'superlink.crt'), certificate.public_bytes(serialization.Encoding.PEM)),
                  _write(os.path.join(folder, 'superlink.key'), _pem_key(key), private=True))


def node_key_pair(folder: str, name: str) -> tuple[str, str]:
  """(private key, public key) files of a new SuperNode identity `name` in `folder`: an EC (P-384) key pair in
  OpenSSH format, as `flower-supernode --auth-supernode-private-key` and `flwr supernode register` read them."""
  os.makedirs(folder, exist_ok=True)
  key = ec.generate_private_key(ec.SECP384R1())
  private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                              serialization.NoEncryption())
  public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
  return (_write(os.path.join(folder, name), private, private=True),
          _write(os.path.join(folder, f'{name}.pub'), public + b'\n'))

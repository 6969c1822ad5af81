"""Wallet files in Solana's format, and wallet↔peer-id link statements."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from solders.keypair import Keypair

from kvasird.settlement.errors import WalletError
from kvasird.settlement.wallet import Wallet, WalletLink, read_keypair, sign_link, write_keypair


def test_keypair_file_round_trips_in_solana_json_format(tmp_path: Path) -> None:
    keypair = Keypair()
    path = tmp_path / "wallet.json"
    write_keypair(path, keypair)
    assert json.loads(path.read_text()) == list(bytes(keypair))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_keypair(path) == keypair
    with pytest.raises(WalletError, match="already exists"):
        write_keypair(path, Keypair())


def test_world_readable_or_malformed_keypair_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "wallet.json"
    write_keypair(path, Keypair())
    os.chmod(path, 0o644)
    with pytest.raises(WalletError, match="chmod 600"):
        read_keypair(path)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2, 3]")
    os.chmod(bad, 0o600)
    with pytest.raises(WalletError, match="64 numbers"):
        read_keypair(bad)


def test_address_only_wallet_cannot_sign() -> None:
    wallet = Wallet.load(None, str(Keypair().pubkey()))
    with pytest.raises(WalletError, match="only the address"):
        wallet.signer()


def test_link_statement_verifies_and_forgeries_do_not() -> None:
    keypair = Keypair()
    wire = sign_link(keypair, "12D3KooWNode", "kvasir-local").to_wire()
    assert WalletLink.from_wire(wire).wallet == keypair.pubkey()
    for tampered in (
        {"peer_id": "12D3KooWThief"},
        {"network": "other"},
        {"wallet": str(Keypair().pubkey())},
    ):
        with pytest.raises(WalletError, match="not signed"):
            WalletLink.from_wire(wire | tampered)

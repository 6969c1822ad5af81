"""KVR token instructions shared by consumers, payouts and the local faucet.

Amounts are integers in base units everywhere (1 KVR = 10**KVR_DECIMALS base units);
floats never touch money.
"""

from __future__ import annotations

from solders.instruction import Instruction
from solders.pubkey import Pubkey
from spl.memo.constants import MEMO_PROGRAM_ID
from spl.memo.instructions import create_memo
from spl.memo.models import MemoParams
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import (
    create_idempotent_associated_token_account,
    get_associated_token_address,
    mint_to_checked,
    transfer_checked,
)
from spl.token.models import MintToCheckedParams, TransferCheckedParams

KVR_DECIMALS = 6
"""Decimals of the KVR mint."""


def format_kvr(base_units: int) -> str:
    """Base units as KVR with every decimal ("1.500000"), for people to read."""
    sign, n = ("-", -base_units) if base_units < 0 else ("", base_units)
    whole, frac = divmod(n, 10**KVR_DECIMALS)
    return f"{sign}{whole}.{frac:0{KVR_DECIMALS}d}"


def token_account(owner: Pubkey, mint: Pubkey) -> Pubkey:
    """The owner's associated token account for ``mint``."""
    return get_associated_token_address(owner, mint)


def transfer_instructions(
    sender: Pubkey, recipient: Pubkey, mint: Pubkey, amount: int, memo: bytes | None = None
) -> list[Instruction]:
    """Create the recipient's account if needed, transfer, and optionally attach a memo."""
    ixs = [
        create_idempotent_associated_token_account(sender, recipient, mint),
        transfer_checked(
            TransferCheckedParams(
                program_id=TOKEN_PROGRAM_ID,
                source=token_account(sender, mint),
                mint=mint,
                dest=token_account(recipient, mint),
                owner=sender,
                amount=amount,
                decimals=KVR_DECIMALS,
            )
        ),
    ]
    if memo is not None:
        ixs.append(memo_instruction(sender, memo))
    return ixs


def mint_instructions(
    authority: Pubkey, recipient: Pubkey, mint: Pubkey, amount: int
) -> list[Instruction]:
    return [
        create_idempotent_associated_token_account(authority, recipient, mint),
        mint_to_checked(
            MintToCheckedParams(
                program_id=TOKEN_PROGRAM_ID,
                mint=mint,
                dest=token_account(recipient, mint),
                mint_authority=authority,
                amount=amount,
                decimals=KVR_DECIMALS,
            )
        ),
    ]


def memo_instruction(signer: Pubkey, memo: bytes) -> Instruction:
    return create_memo(MemoParams(program_id=MEMO_PROGRAM_ID, signer=signer, message=memo))


def memos(program_ids: list[Pubkey], data: list[bytes]) -> list[bytes]:
    """Memo payloads among top-level instructions (program ids aligned with their data)."""
    return [d for p, d in zip(program_ids, data, strict=True) if p == MEMO_PROGRAM_ID]

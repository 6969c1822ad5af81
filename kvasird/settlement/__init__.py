"""Settlement on Solana: local chain, pay-per-inference, receipts, claims, floating price.

The rule: credit only what the chain proves, never what a client asserts; every
balance has exactly one writer.

    config.py       SettlementConfig: what an operator may set (never the price band)
    errors.py       SettlementError and its tree
    token.py        KVR amounts (base units) and SPL transfer/mint/memo instructions
    wallet.py       operator keypair file / address-only wallet; wallet↔peer-id link statements
    chain.py        ChainClient: solana-py AsyncClient under trio; typed ChainTransaction
    localchain/     LiteSVM behind a JSON-RPC facade on 127.0.0.1 (KVR mint, faucet, persistence)
    ledger.py       SQLite (WAL) tables of every money fact
    locks.py        per-key locks around each money operation
    verify.py       what a transaction proves: vault delta, mint, memo binding, sender binding
    payments.py     quotes → payment verification (one-shot signatures), prepaid deposits
    pricing.py      NetworkParams and the utilization-driven PriceController
    governance.py   network parameters change only by genesis-signed, versioned messages
    rewards.py      gateway-measured work → tiers → revenue split → earnings and receipts
    receipts.py     signed cumulative receipts; the peer's ReceiptBook and exposure limit
    claims.py       payouts (claims, refunds): pending record → send → confirm → debit; reconcile
    admin.py        operator sign-in: SIWS wallet signature + TOTP with replay protection
    service.py      run_settlement(): assembles all of it for the daemon

Data flow (gateway):

    consumer ──quote──▶ Payments.quote ──(request id private, memo public)──▶ consumer pays vault
    consumer ──signature──▶ Payments.settle_quote ──ChainClient.transaction──▶ verify ──▶ ledger
    inference done ──MeasuredWork (gateway's own counts)──▶ Rewards.settle ──▶ earnings, receipts
    inference failed ──▶ Rewards.fail ──▶ Payouts.refund (insurance pool → payer, on chain)
    peer ──claim──▶ Payouts.claim ──lock──▶ pending payout ──send/confirm──▶ debit
"""

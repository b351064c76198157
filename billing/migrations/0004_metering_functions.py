"""Reserve and settle as one PostgreSQL function call each (billing/metering.py calls them).

The Python path of billing.metering sends 7-8 statements per reserve or settle plus BEGIN and
COMMIT; each round trip costs more CPU on both sides than the work it carries. These
functions do the same writes, in the same lock order (hold, key spend, accounts by id), in one
statement: called outside a transaction, the call is its own transaction, so a refusal raised
anywhere in it rolls all of it back. The arithmetic stays in Python (billing/pricing.py): the
caller passes the amounts, and settle checks them against the hold row before moving money.

Refusals are raised with SQLSTATEs of our own, mapped back to the same errors as the Python
path by billing.metering: RS402 an account cannot cover the debit (DETAIL: the account id),
RS429 the key's spend limit, RS409 the hold is closed (DETAIL: its status), RS404 no such hold,
RS422 the arguments do not match the rows (a caller's bug; nothing moves).

Both functions write what billing.ledger.post writes: a transfer whose entries sum to zero, and
the running balances of wallet and holds by conditional UPDATE checked by row count (no
overdraft); the database's own checks (migrations 0002, 0003) apply to them as to any writer.
No EXCEPTION blocks: a subtransaction per call would cost more than the rest.
"""

from django.db import migrations

SQL = [
    # Raised when a debit or credit found no row: too little money, or the wrong account.
    """
    CREATE FUNCTION billing_account_refuse(p_account bigint, p_owner bigint, p_kind text)
    RETURNS void AS $$
    BEGIN
        IF EXISTS (SELECT FROM billing_account
                    WHERE id = p_account AND owner_id = p_owner AND kind = p_kind) THEN
            RAISE EXCEPTION 'ledger: account % cannot cover this debit', p_account
                USING ERRCODE = 'RS402', DETAIL = p_account::text;
        END IF;
        RAISE EXCEPTION 'ledger: account % is not the % account of user %', p_account, p_kind,
            p_owner USING ERRCODE = 'RS422';
    END $$ LANGUAGE plpgsql;
    """,
    """
    CREATE FUNCTION billing_reserve(
        p_request_id text, p_user_id bigint, p_key_id bigint, p_model text, p_amount bigint,
        p_price_id bigint, p_spend_start timestamptz, p_spend_limit bigint,
        p_now timestamptz, p_expires_at timestamptz, p_wallet bigint, p_holds bigint,
        OUT hold_id bigint, OUT amount_micros bigint, OUT user_id bigint, OUT price_id bigint,
        OUT input_per_mtok bigint, OUT output_per_mtok bigint, OUT replayed boolean)
    AS $$
    BEGIN
        -- The hold row first: its unique request id turns a replay into a read before any
        -- limit or balance is touched (a concurrent twin waits here, then reads).
        INSERT INTO billing_hold (request_id, user_id, api_key_id, model, amount_micros,
                                  price_id, spend_period_start, status, created_at, expires_at)
        VALUES (p_request_id, p_user_id, p_key_id, p_model, p_amount, p_price_id,
                p_spend_start, 'pending', p_now, p_expires_at)
        ON CONFLICT (request_id) DO NOTHING
        RETURNING id INTO hold_id;
        IF hold_id IS NULL THEN
            SELECT h.id, h.amount_micros, h.user_id, h.price_id, p.input_micros_per_mtok,
                   p.output_micros_per_mtok, true
              INTO hold_id, amount_micros, user_id, price_id, input_per_mtok, output_per_mtok,
                   replayed
              FROM billing_hold h JOIN billing_modelprice p ON p.id = h.price_id
             WHERE h.request_id = p_request_id;
            RETURN;
        END IF;
        -- New rows lock nothing others wait for: written before the contended rows, so those
        -- stay locked for as short a time as possible.
        WITH transfer AS (
            INSERT INTO billing_transfer (kind, idempotency_key, reference, memo, created_at)
            VALUES ('reserve', 'reserve:' || p_request_id, 'request:' || p_request_id, '',
                    p_now)
            RETURNING id)
        INSERT INTO billing_entry (transfer_id, account_id, amount_micros)
        SELECT transfer.id, leg.account, leg.amount
          FROM transfer,
               (VALUES (p_wallet, -p_amount), (p_holds, p_amount)) AS leg (account, amount);
        IF p_spend_start IS NOT NULL THEN
            UPDATE billing_keyspend SET used_micros = used_micros + p_amount
             WHERE api_key_id = p_key_id AND period_start = p_spend_start
               AND used_micros + p_amount <= p_spend_limit;
            IF NOT FOUND THEN  -- the period's first request, or the limit is reached
                INSERT INTO billing_keyspend (api_key_id, period_start, used_micros)
                VALUES (p_key_id, p_spend_start, 0)
                ON CONFLICT (api_key_id, period_start) DO NOTHING;
                UPDATE billing_keyspend SET used_micros = used_micros + p_amount
                 WHERE api_key_id = p_key_id AND period_start = p_spend_start
                   AND used_micros + p_amount <= p_spend_limit;
                IF NOT FOUND THEN
                    RAISE EXCEPTION 'key % reached its spend limit', p_key_id
                        USING ERRCODE = 'RS429';
                END IF;
            END IF;
        END IF;
        -- Accounts in id order, as everywhere.
        IF p_holds < p_wallet THEN
            UPDATE billing_account SET balance_micros = balance_micros + p_amount
             WHERE id = p_holds AND owner_id = p_user_id AND kind = 'holds';
            IF NOT FOUND THEN
                PERFORM billing_account_refuse(p_holds, p_user_id, 'holds');
            END IF;
        END IF;
        UPDATE billing_account SET balance_micros = balance_micros - p_amount
         WHERE id = p_wallet AND owner_id = p_user_id AND kind = 'wallet'
           AND balance_micros >= p_amount;
        IF NOT FOUND THEN
            PERFORM billing_account_refuse(p_wallet, p_user_id, 'wallet');
        END IF;
        IF p_holds > p_wallet THEN
            UPDATE billing_account SET balance_micros = balance_micros + p_amount
             WHERE id = p_holds AND owner_id = p_user_id AND kind = 'holds';
            IF NOT FOUND THEN
                PERFORM billing_account_refuse(p_holds, p_user_id, 'holds');
            END IF;
        END IF;
        replayed := false;
    END $$ LANGUAGE plpgsql;
    """,
    """
    CREATE FUNCTION billing_settle(
        p_request_id text, p_user_id bigint, p_amount bigint, p_price_id bigint,
        p_holds bigint, p_wallet bigint, p_platform bigint, p_earnings bigint,
        p_cost bigint, p_fee bigint, p_provider_share bigint, p_provider_id bigint,
        p_worker text, p_prompt integer, p_completion integer, p_estimated boolean,
        p_capped boolean, p_now timestamptz,
        OUT cost_micros bigint, OUT prompt_tokens integer, OUT completion_tokens integer,
        OUT estimated boolean, OUT capped boolean)
    AS $$
    DECLARE
        v_hold billing_hold%ROWTYPE;
        v_back bigint := p_amount - p_cost;  -- the unused part of the hold, back to the wallet
    BEGIN
        -- Locks the hold and closes it in one statement: of concurrent settles, one finds it
        -- pending; the others wait for it, then find it settled and return its charge.
        UPDATE billing_hold SET status = 'settled', closed_at = p_now
         WHERE request_id = p_request_id AND status = 'pending'
        RETURNING * INTO v_hold;
        IF v_hold.id IS NULL THEN
            SELECT * INTO v_hold FROM billing_hold WHERE request_id = p_request_id;
            IF v_hold.id IS NULL THEN
                RAISE EXCEPTION 'no hold for request %', p_request_id USING ERRCODE = 'RS404';
            ELSIF v_hold.status <> 'settled' THEN
                RAISE EXCEPTION 'request % was already %', p_request_id, v_hold.status
                    USING ERRCODE = 'RS409', DETAIL = v_hold.status;
            END IF;
            SELECT c.cost_micros, c.prompt_tokens, c.completion_tokens, c.estimated, c.capped
              INTO cost_micros, prompt_tokens, completion_tokens, estimated, capped
              FROM billing_charge c WHERE c.request_id = p_request_id;
            RETURN;
        END IF;
        IF v_hold.amount_micros <> p_amount OR v_hold.price_id <> p_price_id
           OR v_hold.user_id <> p_user_id OR p_cost < 0 OR p_cost > p_amount
           OR p_fee < 0 OR p_provider_share < 0 OR p_fee + p_provider_share <> p_cost THEN
            RAISE EXCEPTION 'settle of request % does not match its hold', p_request_id
                USING ERRCODE = 'RS422';
        END IF;
        -- One statement for the three new rows: each statement run here costs an executor
        -- start-up, about as much as an index insert.
        WITH transfer AS (
            INSERT INTO billing_transfer (kind, idempotency_key, reference, memo, created_at)
            VALUES ('settle', 'settle:' || p_request_id, 'request:' || p_request_id, '',
                    p_now)
            RETURNING id),
        legs AS (
            INSERT INTO billing_entry (transfer_id, account_id, amount_micros)
            SELECT transfer.id, leg.account, leg.amount
              FROM transfer, (VALUES (p_holds, -p_amount), (p_wallet, v_back),
                                     (p_platform, p_fee), (p_earnings, p_provider_share))
                             AS leg (account, amount)
             WHERE leg.amount <> 0)
        INSERT INTO billing_charge (request_id, hold_id, user_id, api_key_id, model,
                                    provider_id, worker, prompt_tokens, completion_tokens,
                                    cost_micros, provider_micros, fee_micros, estimated, capped,
                                    transfer_id, created_at)
        SELECT p_request_id, v_hold.id, v_hold.user_id, v_hold.api_key_id, v_hold.model,
               p_provider_id, p_worker, p_prompt, p_completion, p_cost, p_provider_share,
               p_fee, p_estimated, p_capped, transfer.id, p_now
          FROM transfer;
        IF v_hold.spend_period_start IS NOT NULL AND v_back <> 0 THEN
            UPDATE billing_keyspend SET used_micros = used_micros - v_back
             WHERE api_key_id = v_hold.api_key_id AND period_start = v_hold.spend_period_start;
        END IF;
        -- Accounts in id order; platform revenue and earnings keep no running balance.
        IF p_wallet < p_holds AND v_back <> 0 THEN
            UPDATE billing_account SET balance_micros = balance_micros + v_back
             WHERE id = p_wallet AND owner_id = p_user_id AND kind = 'wallet';
            IF NOT FOUND THEN
                PERFORM billing_account_refuse(p_wallet, p_user_id, 'wallet');
            END IF;
        END IF;
        UPDATE billing_account SET balance_micros = balance_micros - p_amount
         WHERE id = p_holds AND owner_id = p_user_id AND kind = 'holds'
           AND balance_micros >= p_amount;
        IF NOT FOUND THEN
            PERFORM billing_account_refuse(p_holds, p_user_id, 'holds');
        END IF;
        IF p_wallet > p_holds AND v_back <> 0 THEN
            UPDATE billing_account SET balance_micros = balance_micros + v_back
             WHERE id = p_wallet AND owner_id = p_user_id AND kind = 'wallet';
            IF NOT FOUND THEN
                PERFORM billing_account_refuse(p_wallet, p_user_id, 'wallet');
            END IF;
        END IF;
        cost_micros := p_cost;
        prompt_tokens := p_prompt;
        completion_tokens := p_completion;
        estimated := p_estimated;
        capped := p_capped;
    END $$ LANGUAGE plpgsql;
    """,
]

REVERSE = [
    "DROP FUNCTION IF EXISTS billing_settle(text, bigint, bigint, bigint, bigint, bigint, bigint,"
    " bigint, bigint, bigint, bigint, bigint, text, integer, integer, boolean, boolean,"
    " timestamptz);",
    "DROP FUNCTION IF EXISTS billing_reserve(text, bigint, bigint, text, bigint, bigint,"
    " timestamptz, bigint, timestamptz, timestamptz, bigint, bigint);",
    "DROP FUNCTION IF EXISTS billing_account_refuse(bigint, bigint, text);",
]


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for statement in SQL:
            schema_editor.execute(statement, params=None)


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for statement in REVERSE:
            schema_editor.execute(statement, params=None)


class Migration(migrations.Migration):
    dependencies = [("billing", "0003_ledger_entry_guard")]
    operations = [migrations.RunPython(forward, backward)]

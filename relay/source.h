/*
 * source.h — what the relay core needs from a database holding an outbox.
 * The core never names PostgreSQL or SQL Server: it talks to this ops table.
 *
 * Asynchronous part (the daemon): every request returns at once; its result
 * arrives later, on the loop thread, through cbs->on_done, exactly once —
 * unless the source is destroyed first (then never). The core issues at most
 * one request at a time per source. A request issued while the source is not
 * UP fails at once through on_done with ok = -1 (never synchronously inside
 * the call: on_done always runs from the loop).
 *
 * Synchronous part (admin commands: check, init, stats, dead): blocking calls
 * bounded by the outbox's connect/query timeouts, each opening and closing its
 * own connection.
 */
#ifndef RELAY_SOURCE_H
#define RELAY_SOURCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "config/cfg.h"
#include "relay/row.h"

struct ev_loop;
typedef struct source source;

enum src_state { SRC_DOWN = 0, SRC_UP = 1 };

enum src_req {
    SRC_REQ_LEAD = 1,  /* take, or renew, the outbox's leadership lease */
    SRC_REQ_CLAIM,     /* lease up to n claimable rows in id order */
    SRC_REQ_SETTLE,    /* apply outcomes */
    SRC_REQ_CLEANUP,   /* delete marked rows older than retention, bounded */
    SRC_REQ_STATS,     /* backlog, oldest pending age, dead count */
    SRC_REQ_HEALTH     /* the table's health: dead tuples, size, vacuum, xmin horizon
                          (SQL Server: ghost records, pages, version store) */
};

/* What happened to a claimed row. */
enum src_outcome_kind {
    SRC_SENT = 0,   /* confirmed: mark sent_at (on_sent=mark) or delete (on_sent=delete) */
    SRC_RETRY,      /* failed attempt: attempts+1, last_error, available_at = now()+backoff, lease cleared */
    SRC_DEAD,       /* move to the dead-letter table with reason, in one transaction */
    SRC_UNCLAIM     /* give back without counting an attempt (never published, or connection lost) */
};

typedef struct src_outcome {
    int64_t     id;
    int64_t     lease_token;  /* applied only where the row still carries this token */
    enum src_outcome_kind kind;
    int64_t     backoff_ms;   /* SRC_RETRY */
    const char *reason;       /* SRC_RETRY, SRC_DEAD: stored as last_error / reason */
} src_outcome;

typedef struct src_stats {
    int64_t backlog;            /* rows with sent_at NULL */
    double  oldest_pending_s;   /* now - min(created_at) of pending rows; 0 when none */
    int64_t dead;               /* rows in the dead-letter table */
    int64_t sent_kept;          /* marked rows awaiting retention; -1 when not counted
                                   (the periodic refresh; `stats` counts them) */
    double  next_due_s;         /* seconds until the first pending row that is not claimable
                                   now (delayed, backing off, leased) becomes so; -1: none
                                   or not known */
    char    leader[256];        /* the relay holding the leadership lease now ("": none):
                                   while there is one, a relay in competing mode claims
                                   nothing */
} src_stats;

/* The outbox table's health as the database sees it (SRC_REQ_HEALTH), and what holds
   the database's xmin horizon back: the oldest snapshot a session keeps open (a long or
   idle-in-transaction transaction, pg_dump) or a replication slot's xmin. While it is
   held, vacuum removes no row version that died after it, and every scan of the pending
   rows walks over the dead ones. */
typedef struct src_health {
    int64_t     dead_tuples;     /* estimated dead row versions; -1 unknown */
    int64_t     live_tuples;     /* estimated live rows; -1 unknown */
    int64_t     size_bytes;      /* table + indexes + TOAST; -1 unknown */
    double      last_autovacuum; /* Unix time of the last autovacuum; 0 never; -1 unknown */
    bool        horizon_known;   /* false: the relay's role cannot see other sessions'
                                    snapshots (needs pg_read_all_stats) */
    /* the holder of the oldest xmin (the horizon), when there is one (kind != NULL);
       the strings are valid during the callback only */
    const char *holder_kind;     /* "session" or "replication slot"; NULL: none */
    bool        holder_versions; /* the holder is the oldest transaction reading or making
                                    row versions (SQL Server, below), not a session's
                                    snapshot or a slot; holder_kind only names it */
    int         holder_pid;      /* session: its backend pid; slot: 0 */
    const char *holder_name;     /* session: application_name; slot: the slot's name */
    const char *holder_state;    /* session: state (e.g. "idle in transaction"); slot:
                                    "active" or "inactive" */
    double      holder_age_s;    /* session: how long its transaction has been open; slot:
                                    -1 (the database does not say since when) */
    int64_t     horizon_xids;    /* the horizon's age in transaction IDs */
    const char *holder_xmin;     /* the held xmin, to tell one holder's episode from the next */
    /* SQL Server: the fields above hold ghost records (dead_tuples), rows (live_tuples),
       reserved pages in bytes (size_bytes), and the oldest transaction reading or making
       row versions, which holds the version store and the ghost records it may still
       read (holder_versions set, holder_kind "snapshot transaction", holder_pid its
       session id, holder_name its program_name, holder_state its isolation, holder_xmin
       its transaction sequence number); these are SQL Server's own: */
    int64_t     used_bytes;      /* used pages in bytes */
    int64_t     version_store_bytes; /* the version store's size for the database */
    unsigned    have;            /* the values this read gives (SRC_H_*); 0: SRC_H_POSTGRES */
} src_health;

/* src_health.have: which values a health read gives (the others are left out of the
   metrics, not reported as unknown). */
enum {
    SRC_H_DEAD = 1u << 0, SRC_H_LIVE = 1u << 1, SRC_H_SIZE = 1u << 2, SRC_H_VACUUM = 1u << 3,
    SRC_H_HORIZON_S = 1u << 4, SRC_H_HORIZON_XIDS = 1u << 5, SRC_H_USED = 1u << 6,
    SRC_H_VSTORE = 1u << 7,
    SRC_H_NONE = 1u << 15    /* read, nothing to give */
};
#define SRC_H_POSTGRES \
    (SRC_H_DEAD | SRC_H_LIVE | SRC_H_SIZE | SRC_H_VACUUM | SRC_H_HORIZON_S | SRC_H_HORIZON_XIDS)

typedef struct src_result {
    enum src_req req;
    int         ok;             /* 0 success, -1 failed (error says why; the source may go DOWN) */
    const char *error;          /* valid during the callback only */
    /* SRC_REQ_LEAD */
    bool        leader;         /* this instance holds the lease now (taken or renewed) */
    bool        newly_leader;   /* taken by this request with a new epoch (row leases were reset) */
    int64_t     epoch;          /* our epoch when leader */
    const char *holder;         /* current holder when not leader (NULL: none); callback only */
    int64_t     holder_epoch;
    int64_t     n_reset;        /* row leases released by a takeover */
    const char *member;         /* not leader because this relay in competing mode is live
                                   (NULL: none); callback only */
    /* SRC_REQ_CLAIM: ownership of rows[] and of every row passes to the callee
       (free each with row_free and the array with free); rows are in id order */
    row       **rows;
    size_t      n_rows;
    /* SRC_REQ_SETTLE */
    size_t      n_applied;      /* outcomes whose token still matched */
    /* SRC_REQ_CLEANUP */
    size_t      n_deleted;
    /* SRC_REQ_STATS */
    src_stats   stats;
    /* SRC_REQ_HEALTH */
    src_health  health;
} src_result;

typedef struct src_cbs {
    void *ud;
    /* Connection state changes. UP: connected, database name verified, schema
       present, LISTEN issued (PostgreSQL, when on_wake is set: a source without it
       is not woken). DOWN: lost or failed; msg says why.
       After DOWN the source reconnects by itself with capped back-off. */
    void (*on_state)(void *ud, enum src_state state, const char *msg);
    /* A wake-up hint (NOTIFY); rows may be claimable. */
    void (*on_wake)(void *ud);
    /* Completion of the one outstanding request. */
    void (*on_done)(void *ud, const src_result *res);
} src_cbs;

typedef struct src_claim_args {
    size_t      max_rows;
    /* The bytes the claimed rows may hold (src_row_bytes summed), 0: no limit. Rows are
       taken in id order while their running sum stays within max_bytes, so a claim never
       hands over more; with first_whole its first row comes whatever its size (alone
       when it is larger), so a row larger than the whole budget still goes through.
       Honoured only by a source whose claims_bytes says so. */
    size_t      max_bytes;
    bool        first_whole;
    /* A row whose payload is larger than this (the sink's max_message_size: it could
       never be published) comes without it: payload_withheld says its size, and it
       counts for its headers only within max_bytes. 0: every payload comes. Honoured
       by a source whose claims_bytes says so. */
    size_t      max_payload;
    int64_t     lease_ms;
    int64_t     lease_token;  /* the core's random token for this claim */
    const char *owner;        /* this relay instance, stored in lease_owner */
    int64_t     epoch;        /* > 0 (leader mode): claim nothing unless (owner, epoch)
                                 still holds an unexpired leadership lease (fencing) */
    bool        competing;    /* claim a key's rows only from its first pending row on,
                                 and only when no other instance holds that one */
    /* Rows this relay holds under a lease of its own that is still live (n_held of them,
       borrowed for the call): the claim would not take them anyway, and a source may pass
       over them without looking (the PostgreSQL claim does, within its index walk). A
       hint: ignoring it changes nothing but the claim's cost. */
    const int64_t *held;
    size_t      n_held;
    /* The tokens of this relay's earlier claims that failed without an answer, whose
       leases have not run out yet (n_lost of them, borrowed for the call): such a claim
       may have committed (its answer lost with the connection, a timeout the server did
       not act on), leasing rows this relay never got. The claim takes rows leased under
       these tokens as if their lease had ended, and in competing mode counts them as
       not ours for its per-key check: otherwise later claims would pass over them (a live
       lease) and take later rows of their keys first. Every source must honour it. */
    const int64_t *lost;
    size_t      n_lost;
    /* Rows went back to the table since the last claim (a settle gave their leases up, or
       set them to be retried later): a source whose claims may start past rows they
       passed over (PostgreSQL, while a transaction is still open) walks from its start
       this time, so that those rows are not left waiting. Their keys' order holds either
       way. */
    bool        given_back;
} src_claim_args;

/* Leadership is a lease row per outbox (<table>_lease, name 'leader': owner,
   epoch, expires_at in database time), never a session lock: it survives
   PgBouncer transaction pooling and ODBC reconnections, and a frozen holder
   loses it when it expires. */
typedef struct src_lead_args {
    const char *owner;        /* this relay instance: "<relay name>/<random hex>" */
    int64_t     epoch;        /* the epoch this instance holds, 0 when none */
    int64_t     lease_ms;     /* the lease runs this long from the database's now() */
} src_lead_args;

typedef struct src_cleanup_args {
    int64_t     retention_ms;
    size_t      limit;
    const char *owner;        /* with epoch > 0: fenced like a claim */
    int64_t     epoch;
} src_cleanup_args;

typedef struct source_ops {
    const char *name;  /* "postgres", "sqlserver" */

    /* --- daemon (asynchronous, loop thread) --- */
    int  (*create)(struct ev_loop *loop, const cfg_outbox *cfg, const src_cbs *cbs,
                   source **out, char *err, size_t errlen);
    void (*destroy)(source *s);           /* closes; no callback afterwards */
    void (*start)(source *s);             /* begin connecting; on_state reports */
    int  (*lead)(source *s, const src_lead_args *a);
    int  (*claim)(source *s, const src_claim_args *a);
    int  (*settle)(source *s, const src_outcome *v, size_t n);  /* v copied before return */
    int  (*cleanup)(source *s, const src_cleanup_args *a);
    int  (*stats)(source *s);
    /* True while each commit to the outbox wakes this connection (LISTEN/NOTIFY is up
       and reaches it); the core then polls only as a safety net. NULL: never. */
    bool (*notifies)(const source *s);
    /* True when this source's claims honour src_claim_args.max_bytes (the database
       stops at the byte limit). NULL or false: the core cannot ask for a byte limit and
       claims at most as many rows as fit at the sink's max_message_size each. */
    bool (*claims_bytes)(const source *s);
    /* Reads the table's health (SRC_REQ_HEALTH), a request like the others. NULL: the
       source has none to give. */
    int  (*health)(source *s);
    /* host:port/database (or what names the server) of a connection string, for log
       lines: nothing secret. Called through source_peer (both strings set, len > 0). */
    void (*peer)(const char *conninfo, const char *database, char *buf, size_t len);

    /* --- admin (synchronous, blocking with timeouts) --- */
    /* Connects, verifies database name and schema. 0 ok; -1 with one line per problem in err.
       On 0, err may hold warnings (e.g. LISTEN/NOTIFY cannot reach the connection). */
    int  (*check)(const cfg_outbox *cfg, char *err, size_t errlen);
    /* Applies the DDL idempotently. On 0, err may say what was created or skipped. */
    int  (*init)(const cfg_outbox *cfg, char *err, size_t errlen);
    int  (*stats_sync)(const cfg_outbox *cfg, src_stats *out, char *err, size_t errlen);
    /* Dead letters: list prints one line per row to out (id, message_id, exchange,
       routing_key, attempts, dead_at, reason); retry moves rows back into the
       outbox (attempts reset, same id and message_id); purge deletes them.
       ids == NULL/n_ids == 0 means all. *affected gets the row count. */
    int  (*dead_list)(const cfg_outbox *cfg, FILE *out, char *err, size_t errlen);
    int  (*dead_retry)(const cfg_outbox *cfg, const int64_t *ids, size_t n_ids,
                       size_t *affected, char *err, size_t errlen);
    int  (*dead_purge)(const cfg_outbox *cfg, const int64_t *ids, size_t n_ids,
                       size_t *affected, char *err, size_t errlen);
} source_ops;

/* The size of a row for the byte budget: its payload and its headers as text, the
   part of a row that can be large (the claim's running sum counts the same columns);
   row_new computed it once. */
static inline size_t src_row_bytes(const row *r)
{
    return r->bytes;
}

/* The ops of an outbox's source (registered by sources/, found by config/). */
static inline const source_ops *source_ops_of(const cfg_outbox *ob)
{
    return (const source_ops *)ob->source->ops;
}

/* The peer of an outbox's database for log lines; always writes a string when len > 0. */
static inline void source_peer(const cfg_outbox *ob, char *buf, size_t len)
{
    const char *db = ob->database ? ob->database : "?";

    if (len == 0)
        return;
    if (ob->conninfo == NULL)
        snprintf(buf, len, "?/%s", db);
    else
        source_ops_of(ob)->peer(ob->conninfo, db, buf, len);
}

/* Writes one line of dead_list's output: the n fields tab-separated, a NULL field
   empty, and in each field tab, newline, carriage return and backslash escaped as
   \t \n \r \\ (a line is always one row). */
void source_dead_line(FILE *out, const char *const *field, size_t n);

#endif

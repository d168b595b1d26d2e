/*
 * cfg.h — the relay's configuration (every key: config/README.md): parse → validate → use.
 *
 * cfg_load() reads an ini file with iniparser, takes every value as a raw
 * string and parses it strictly itself. It never touches live state: on any
 * error the caller gets NULL and one line per problem, each naming the file,
 * the section, the key and what was expected, e.g.
 *   relay.ini: [outbox.orders] batch_size: expected an integer 1..100000, got "abc"
 * Secrets (${ENV} in any value, *_file keys) are resolved here and never logged.
 */
#ifndef CFG_H
#define CFG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "outbox_util.h" /* OUTBOX_MUST_CHECK */

enum cfg_log_level { CFG_LOG_ERROR = 0, CFG_LOG_WARN, CFG_LOG_INFO, CFG_LOG_DEBUG };
enum cfg_log_format { CFG_LOG_TEXT = 0, CFG_LOG_JSON };
enum cfg_on_sent { CFG_ON_SENT_MARK = 0, CFG_ON_SENT_DELETE };
enum cfg_mode { CFG_MODE_LEADER = 0, CFG_MODE_COMPETING };
enum cfg_ordering { CFG_ORDER_PIPELINED = 0, CFG_ORDER_STRICT };
/* cfg.c stores every CFG_KT_ENUM key through an int */
_Static_assert(sizeof(enum cfg_log_level) == sizeof(int) &&
                   sizeof(enum cfg_log_format) == sizeof(int) &&
                   sizeof(enum cfg_on_sent) == sizeof(int) &&
                   sizeof(enum cfg_mode) == sizeof(int) && sizeof(enum cfg_ordering) == sizeof(int),
               "enum keys are stored as int");

typedef struct cfg_backend cfg_backend;

typedef struct cfg_relay {
    char *name;                     /* default: hostname:pid */
    enum cfg_log_level log_level;   /* default info */
    enum cfg_log_format log_format; /* default text */
    char *log_file;                 /* NULL: stderr; reopened on SIGHUP */
    char *http_listen;              /* "127.0.0.1:9187" default; NULL when empty (disabled) */
    int64_t shutdown_timeout_ms;    /* default 10s */
    int max_rows_in_memory;         /* 0: auto (cfg_max_rows_in_memory) */
    size_t max_bytes_in_memory;     /* default 64M: payload + header bytes of those rows */
} cfg_relay;

/* A sink: what the relay core uses of it, whatever the backend. What only its backend
   understands (what its url means, its own keys) is in backend_conf. */
typedef struct cfg_sink {
    char *name;                 /* the part after "sink." */
    const cfg_backend *type;    /* the registered sink of `type =` (default: the first one) */
    char *url;                  /* where the sink connects (its backend parses it; secret-bearing:
                                   never log); default: the backend's url_default */
    char *password;             /* from password_file, or NULL; the backend applies it */
    int publish_window;         /* default 1000, 1..65535 */
    int64_t confirm_timeout_ms; /* default 30s */
    int64_t connect_timeout_ms; /* default 5s */
    int64_t reconnect_max_ms;   /* capped back-off ceiling, default 30s */
    size_t max_message_size;    /* default 128M; bigger rows are dead-lettered */
    bool confirms;              /* must be true: a sink without delivery confirms is refused */
    void *backend_conf;         /* the backend's own settings (cfg_backend.conf_size), or NULL */
} cfg_sink;

typedef struct cfg_outbox {
    char *name;                /* the part after "outbox." */
    const cfg_backend *source; /* the registered source of `source =` (default: the first one) */
    char *conninfo;            /* the source's connection string (secret-bearing: never log) */
    char *password;            /* from password_file, or NULL; the source applies it */
    char *database;            /* required; compared byte for byte */
    char *table;               /* "schema.table" as configured, default outbox.messages */
    char schema_part[64];      /* validated parts of table */
    char table_part[64];
    char dead_part[64];           /* dead-letter table name (same schema) */
    char *sink_name;              /* default "main" */
    const struct cfg_sink *sink;  /* resolved, points into cfg.sinks */
    int batch_size;               /* default 500 */
    int64_t poll_interval_ms;     /* 0: auto (cfg_poll_interval_ms) */
    int64_t lease_ms;             /* default 30s */
    int max_attempts;             /* default 10 */
    int64_t retry_backoff_ms;     /* first retry delay, doubled per attempt; default 1s */
    int64_t retry_backoff_max_ms; /* cap, default 5m */
    enum cfg_on_sent on_sent;     /* default mark */
    int64_t retention_ms;         /* default 7d */
    int cleanup_batch;            /* rows deleted per retention statement, default 1000 */
    int64_t cleanup_interval_ms;  /* default 10s */
    int64_t claim_delay_ms; /* after a short claim, a woken claim waits this long, default 5ms */
    int64_t health_interval_ms; /* table health read every (0: never), default 15s */
    int64_t horizon_warn_ms;    /* WARN once the xmin horizon is held back this long, default 5m */
    enum cfg_mode mode;         /* default leader */
    enum cfg_ordering ordering; /* default pipelined */
    int64_t query_timeout_ms;   /* statement timeout for the relay's queries, default 30s */
    int64_t connect_timeout_ms; /* default 5s */
    int64_t reconnect_max_ms;   /* default 30s */
    void *backend_conf;         /* the source's own settings (cfg_backend.conf_size), or NULL */
} cfg_outbox;

typedef struct cfg {
    char *path;
    cfg_relay relay;
    cfg_sink *sinks;
    size_t n_sinks;
    cfg_outbox *outboxes;
    size_t n_outboxes;
} cfg;

/* A growable list of error lines (each already prefixed with the file name). */
typedef struct cfg_errors {
    char **lines;
    size_t n;
} cfg_errors;

/* Loads and validates path. Returns 0 and *out, or -1 with errs filled (*out NULL). */
int cfg_load(const char *path, cfg **out, cfg_errors *errs);
void cfg_free(cfg *c);
void cfg_errors_clear(cfg_errors *e);

/* Strict scalar parsers (exposed for unit tests). Return 0 or -1. Durations: "250ms" "1s"
   "5m" "2h" "7d" (bare: seconds); booleans: true/false/yes/no/on/off/1/0; sizes: "1024",
   "64k", "16M", "1G". */
OUTBOX_MUST_CHECK int cfg_parse_duration_ms(const char *s, int64_t *out);
OUTBOX_MUST_CHECK int cfg_parse_int(const char *s, int64_t min, int64_t max, int64_t *out);
OUTBOX_MUST_CHECK int cfg_parse_bool(const char *s, bool *out);
OUTBOX_MUST_CHECK int cfg_parse_size(const char *s, size_t *out);

/* ---- backends ------------------------------------------------------------------
 * config/ knows sections, value types, durations, sizes, secrets and how to report a
 * problem; what a value means to a database or a broker (a libpq conninfo, an ODBC
 * connection string, AMQP URLs) is checked by the backend that uses it. Each source and
 * sink registers one cfg_backend under the name `source =` / `type =` takes
 * (sources/sources.h, sinks/sinks.h: the program registers them before cfg_load), and
 * relay/ finds a section's implementation through the same entry (ops). */
typedef struct cfg_report cfg_report; /* the section being finished, for error lines */

/* A key table: one entry per key of a section, applied to the section's struct (off).
   config/ has one per section kind; a backend adds the keys only it has (cfg_backend),
   applied to its own settings (backend_conf). */
enum cfg_key_type {
    CFG_KT_STR,        /* char *, any text (CFG_KF_NONEMPTY / CFG_KF_EMPTY_NULL) */
    CFG_KT_NAME,       /* char *, printable without spaces, 1..128 bytes */
    CFG_KT_LISTEN,     /* char *, host:port, empty → NULL */
    CFG_KT_ENUM,       /* int */
    CFG_KT_BACKEND,    /* const cfg_backend *, a registered backend of kind `min` */
    CFG_KT_INT,        /* int, min..max */
    CFG_KT_DUR,        /* int64_t ms, min..max */
    CFG_KT_SIZE,       /* size_t, min..max */
    CFG_KT_BOOL,       /* bool */
    CFG_KT_SECRET_FILE /* char *, the file's contents */
};

#define CFG_KF_REQUIRED   0x01 /* no default: must be present */
#define CFG_KF_SECRET     0x02 /* never echo the value */
#define CFG_KF_EMPTY_NULL 0x04 /* an empty value stores NULL */
#define CFG_KF_NONEMPTY   0x08 /* an empty value is an error */
#define CFG_KF_MUST_TRUE  0x10 /* bool that may only be true */
#define CFG_KF_WHOLE_SEC  0x20 /* duration in whole seconds */
#define CFG_KF_READABLE   0x40 /* path that must be readable */
#define CFG_KF_AUTO       0x80 /* CFG_KT_DUR, CFG_KT_INT: "auto" is accepted, stored as 0 */
#define CFG_KF_EXPECT_BACKENDS \
    0x100 /* CFG_KT_STR: expected: what the registered backends of
                                       kind `min` say it holds (cfg_backend.expect), or expect */

#define CFG_MS_S 1000LL /* durations are milliseconds */
#define CFG_MS_M (60LL * CFG_MS_S)
#define CFG_MS_H (60LL * CFG_MS_M)
#define CFG_MS_D (24LL * CFG_MS_H)

typedef struct cfg_key {
    const char *key;
    enum cfg_key_type type;
    unsigned flags;  /* CFG_KF_* */
    const char *def; /* default, parsed like a value; NULL: none */
    int64_t min, max;
    const char *const *names; /* CFG_KT_ENUM: NULL-terminated */
    const int *vals;          /* CFG_KT_ENUM: value per name */
    size_t off;               /* the field in the section's struct */
    const char *expect;       /* CFG_KT_STR/NAME, CFG_KF_MUST_TRUE: what is expected */
} cfg_key;

/* CFG_BACKEND_NONE: a section without a backend ([relay]); never a registered one. */
enum cfg_backend_kind { CFG_BACKEND_NONE = 0, CFG_BACKEND_SOURCE, CFG_BACKEND_SINK };

struct cfg_backend {
    enum cfg_backend_kind kind; /* a source or a sink */
    const char *name;           /* the value of `source =` or `type =` */
    const char *expect;         /* for error lines, what its connection value holds: a
                                       source's conninfo ("a libpq conninfo"), a sink's url */
    const char *url_default;    /* sinks: the url when none is given */
    /* The backend's own settings: conf_size bytes, zeroed, that config/ allocates for each
       section of this backend (cfg_sink / cfg_outbox .backend_conf, freed by cfg_free);
       its keys (in the same section as the generic ones) are applied to it: their `off`
       are offsets in it. 0 / NULL: none. */
    size_t conf_size;
    const cfg_key *keys;
    size_t n_keys;
    /* Checks and completes what only the backend understands, once the section's keys
       are parsed (a URL into its parts, say, in backend_conf); reports each problem with
       cfg_report_error. NULL: nothing to do. */
    void (*finish_outbox)(cfg_outbox *o, cfg_report *r);
    void (*finish_sink)(cfg_sink *s, cfg_report *r);
    /* Frees what a backend_conf holds (not the block itself). NULL: nothing. */
    void (*conf_free)(void *conf);
    /* Reload: whether two backend_confs of sections otherwise equal configure the same
       thing (every field, the contents of files read when connecting included).
       Required with conf_size. */
    bool (*conf_equal)(const void *a, const void *b);
    const void *ops; /* relay/'s source_ops or sink_ops for this backend */
};

#define CFG_MAX_BACKENDS 16
/* Registers b (static storage). Registering the same entry again does nothing.
   -1 when the table is full, another entry of that kind has the name, or b has
   conf_size without conf_equal or keys without conf_size. */
OUTBOX_MUST_CHECK int cfg_register(const cfg_backend *b);
/* The registered backend of kind named name, or NULL. */
const cfg_backend *cfg_backend_find(enum cfg_backend_kind kind, const char *name);

/* One error line for the section being finished: "FILE: [SECTION] KEY: message". */
void cfg_report_error(cfg_report *r, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Frees a string that may hold a secret, overwriting it first. */
void cfg_free_secret(char *s);
/* A character of a host name (letters, digits, '.', '-', '_'). */
bool cfg_host_char_ok(int c);
/* A value quoted for an error line ("..." with control characters escaped, long values
   shortened) in buf; returns buf. Never for a secret. */
const char *cfg_quote(const char *v, char *buf, size_t len);

const char *cfg_log_level_name(int level);

/* poll_interval = auto: how often an idle outbox looks for rows nothing announced. While
   LISTEN/NOTIFY reaches the relay (PostgreSQL, not through a pooler) a notification
   announces each commit, and the poll is only a safety net; without it (SQL Server, a
   pooler) the poll is how rows are found. */
#define CFG_POLL_NOTIFIED_MS   5000
#define CFG_POLL_UNNOTIFIED_MS 1000
/* The poll interval in force: the configured one, or auto's for the case given. */
int64_t cfg_poll_interval_ms(const cfg_outbox *ob, bool notified);

/* max_rows_in_memory = auto: rows all outboxes of the process hold at once (claimed and
   buffered, or in flight): CFG_ROWS_IN_MEMORY_AUTO, or the largest outbox's own bound
   (its sink's publish_window + 2 x batch_size) when that is larger, so that the default
   never narrows a single outbox. */
#define CFG_ROWS_IN_MEMORY_AUTO 10000
size_t cfg_max_rows_in_memory(const cfg *c);

/* Reload (SIGHUP): whether a running drain configured by a can go on unchanged under
   b. Every field is compared (secrets from password files included), the backend's own
   settings through its conf_equal; for an outbox also the settings of the sink it uses,
   so a sink change restarts its outboxes. A field added to cfg_sink or cfg_outbox must
   be compared here too (tests/test_config.py changes every key and expects a difference). */
bool cfg_sink_equal(const cfg_sink *a, const cfg_sink *b);
bool cfg_outbox_equal(const cfg_outbox *a, const cfg_outbox *b);

#endif

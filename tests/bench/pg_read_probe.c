/*
 * pg_read_probe.c — PostgreSQL's own ceiling for reading an outbox's payloads, the
 * yardstick beside the broker's for the relay's big-message run.
 *
 *   pg_read_probe CONNINFO TABLE BATCH_BYTES
 *
 * Reads every row of TABLE (its pending and sent rows alike) in id order, in batches of as
 * many rows as fit in BATCH_BYTES (at least one), on one session, with the payloads in
 * binary: what a claim brings back, without the claim's lease and commit. The payloads
 * are counted and dropped. Prints
 *   pgread rows=N bytes=B secs=S rate=R batches=K
 * with S from the first statement sent to the last answer read. Exit 1 on any failure.
 */
#include <libpq-fe.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t be64(const char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | (unsigned char)p[i];
    return v;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: pg_read_probe CONNINFO TABLE BATCH_BYTES\n");
        return 2;
    }
    long long budget = atoll(argv[3]);
    if (budget <= 0) {
        fprintf(stderr, "pg_read_probe: BATCH_BYTES must be positive\n");
        return 2;
    }
    PGconn *c = PQconnectdb(argv[1]);
    if (PQstatus(c) != CONNECTION_OK) {
        fprintf(stderr, "pg_read_probe: %s", PQerrorMessage(c));
        PQfinish(c);
        return 1;
    }
    /* the rows' sizes first (octet_length reads the stored length only), for the batches */
    char sql[512];
    snprintf(sql, sizeof sql, "SELECT count(*), coalesce(avg(octet_length(payload)), 0)::bigint "
             "FROM %s", argv[2]);
    PGresult *r = PQexec(c, sql);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        fprintf(stderr, "pg_read_probe: %s", PQerrorMessage(c));
        PQclear(r);
        PQfinish(c);
        return 1;
    }
    long long total = atoll(PQgetvalue(r, 0, 0)), avg = atoll(PQgetvalue(r, 0, 1));
    PQclear(r);
    long long batch = avg > 0 ? budget / avg : total;
    if (batch < 1)
        batch = 1;
    snprintf(sql, sizeof sql, "SELECT id, payload FROM %s WHERE id > $1::bigint ORDER BY id "
             "LIMIT $2::bigint", argv[2]);
    char last[24] = "0", lim[24];
    snprintf(lim, sizeof lim, "%lld", batch);
    long long rows = 0, batches = 0;
    uint64_t bytes = 0;
    double t0 = now();
    for (;;) {
        const char *vals[2] = {last, lim};
        r = PQexecParams(c, sql, 2, NULL, vals, NULL, NULL, 1);
        if (PQresultStatus(r) != PGRES_TUPLES_OK) {
            fprintf(stderr, "pg_read_probe: %s", PQerrorMessage(c));
            PQclear(r);
            PQfinish(c);
            return 1;
        }
        int n = PQntuples(r);
        if (n == 0) {
            PQclear(r);
            break;
        }
        for (int i = 0; i < n; i++)
            bytes += (uint64_t)PQgetlength(r, i, 1);
        if (PQgetlength(r, n - 1, 0) != 8) {
            fprintf(stderr, "pg_read_probe: id is not a bigint\n");
            PQclear(r);
            PQfinish(c);
            return 1;
        }
        snprintf(last, sizeof last, "%" PRIu64, be64(PQgetvalue(r, n - 1, 0)));
        rows += n;
        batches++;
        PQclear(r);
    }
    double secs = now() - t0;
    PQfinish(c);
    if (rows != total) {
        fprintf(stderr, "pg_read_probe: read %lld rows of %lld\n", rows, total);
        return 1;
    }
    printf("pgread rows=%lld bytes=%" PRIu64 " secs=%.6f rate=%.1f batches=%lld\n", rows, bytes,
           secs, secs > 0 ? (double)rows / secs : 0.0, batches);
    return 0;
}

/*
 * log.h — one line per event to stderr (or log_file), text or JSON.
 * The logger is process state owned by main (the daemon), not by liboutbox.
 * Never pass secrets (conninfo, URLs with passwords) to it.
 *
 *   log_msg(LOG_WARN, "outbox=%s sink=%s: broker blocked: %s", ob, sk, why);
 */
#ifndef RELAY_LOG_H
#define RELAY_LOG_H

#include "config/cfg.h"

#define LOG_ERROR CFG_LOG_ERROR
#define LOG_WARN  CFG_LOG_WARN
#define LOG_INFO  CFG_LOG_INFO
#define LOG_DEBUG CFG_LOG_DEBUG

void log_setup(int level, int format, const char *file);  /* file NULL: stderr */
int  log_reopen(void);                                    /* SIGHUP; 0 or -1 */
int  log_enabled(int level);
void log_msg(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif

# outbox-relay — top-level Makefile.
#   make                      build what ships: liboutbox (.a/.so), outbox-relay, outbox.pc,
#                             the man pages and examples/ (no test-only package is needed)
#   make test                 build the test programs (they need cmocka), start private
#                             PostgreSQL/RabbitMQ if needed and run every test
#   make test-programs        only build the test programs (tests/c, tests/bench)
#   make SANITIZER=address    (or undefined, or address+undefined) instrumented build
#                             into build-$(SANITIZER)/
#   make VALGRIND=1 test      run the daemon and C test programs under valgrind
#   make valgrind-test        the daemon's end-to-end tests under valgrind (VALGRIND_TESTS)
#   make test TESTS=tests/test_relay.py PYTEST_ARGS="-k leader"   a subset
#   make bench                relay throughput vs. broker ceiling (not part of test)
#   make format-check         the files listed in FORMATTED follow .clang-format
#   make install PREFIX=/usr/local DESTDIR=   (man pages under $(PREFIX)/share/man, or MANDIR=)
#   make deb                  Debian packages outbox-relay, liboutbox1, liboutbox-dev into build/
#                             (debhelper, from deploy/debian/; needs the packages
#                             scripts/packages.txt lists for it)
# The one version of the tree: the binaries, outbox.pc, the man pages and the Debian packages
# (whose debian/changelog `make deb` writes from it) all take it from here.
VERSION    := 0.1.0
SOMAJOR    := 1
SOVERSION  := $(SOMAJOR).0.0
PREFIX     ?= /usr/local
DESTDIR    ?=
CC         ?= cc
OPT        ?= -O2 -g
PYTHON     ?= /usr/bin/python3
PKG_CONFIG ?= pkg-config

ifeq ($(SANITIZER),)
BUILD      ?= build
else
BUILD      ?= build-$(SANITIZER)
endif

WARN := -Wall -Wextra -Wshadow -Wformat=2 -Wstrict-prototypes -Wmissing-prototypes \
        -Wpointer-arith -Wwrite-strings -Wvla -Wundef -Wnull-dereference
ifeq ($(CI),true)
WARN += -Werror
endif

pc_cflags = $(shell $(PKG_CONFIG) --cflags $(1) 2>/dev/null || echo $(2))
pc_libs   = $(shell $(PKG_CONFIG) --libs $(1) 2>/dev/null || echo $(2))

PQ_CFLAGS   := $(call pc_cflags,libpq,-I/usr/include/postgresql)
PQ_LIBS     := $(call pc_libs,libpq,-lpq)
ODBC_CFLAGS := $(call pc_cflags,odbc,)
ODBC_LIBS   := $(call pc_libs,odbc,-lodbc)
AMQP_CFLAGS := $(call pc_cflags,librabbitmq,)
AMQP_LIBS   := $(call pc_libs,librabbitmq,-lrabbitmq)
SSL_LIBS    := $(call pc_libs,openssl,-lssl -lcrypto)
JSON_CFLAGS := $(call pc_cflags,jansson,)
JSON_LIBS   := $(call pc_libs,jansson,-ljansson)
# libev and iniparser ship no .pc file on Debian
EV_LIBS     := -lev
INI_CFLAGS  := -I/usr/include/iniparser
INI_LIBS    := -liniparser

SAN_FLAGS :=
ifeq ($(SANITIZER),address)
SAN_FLAGS := -fsanitize=address -fno-omit-frame-pointer
else ifeq ($(SANITIZER),undefined)
SAN_FLAGS := -fsanitize=undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
else ifeq ($(SANITIZER),address+undefined)
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
else ifneq ($(SANITIZER),)
$(error SANITIZER must be address, undefined or address+undefined)
endif

BASE_CFLAGS := -std=c11 -D_GNU_SOURCE -fPIC -pthread $(WARN) $(OPT) $(SAN_FLAGS) -MMD -MP \
               -Ilib -I. $(PQ_CFLAGS) $(ODBC_CFLAGS) $(AMQP_CFLAGS) $(JSON_CFLAGS) $(INI_CFLAGS) \
               -DOUTBOX_VERSION='"$(VERSION)"'
ALL_CFLAGS  := $(BASE_CFLAGS) $(CFLAGS)
ALL_LDFLAGS := -pthread $(SAN_FLAGS) $(LDFLAGS)
LIB_LIBS    := $(PQ_LIBS) $(ODBC_LIBS)
RELAY_LIBS  := $(LIB_LIBS) $(AMQP_LIBS) $(JSON_LIBS) $(SSL_LIBS) $(EV_LIBS) $(INI_LIBS) -lm

LIB_SRC   := $(wildcard lib/*.c)
RELAY_SRC := $(filter-out relay/main.c,$(wildcard relay/*.c config/*.c sources/*.c sources/*/*.c sinks/*.c sinks/*/*.c))
TEST_SRC  := $(wildcard tests/c/*.c)
BENCH_SRC := $(wildcard tests/bench/*.c)
EXAMPLE_SRC := $(wildcard examples/*.c)
MAN_SRC   := man/outbox-relay.1 man/outbox-relay.ini.5

LIB_OBJ   := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
RELAY_OBJ := $(RELAY_SRC:%.c=$(BUILD)/obj/%.o)
MAIN_OBJ  := $(BUILD)/obj/relay/main.o
TEST_BIN  := $(TEST_SRC:tests/c/%.c=$(BUILD)/tests/%)
BENCH_BIN := $(BENCH_SRC:tests/bench/%.c=$(BUILD)/tests/%)
EXAMPLE_BIN := $(EXAMPLE_SRC:examples/%.c=$(BUILD)/examples/%)
MAN_OUT   := $(MAN_SRC:man/%=$(BUILD)/man/%)

LIBA  := $(BUILD)/liboutbox.a
LIBSO := $(BUILD)/liboutbox.so.$(SOVERSION)
RELAY := $(BUILD)/outbox-relay
RELAYA := $(BUILD)/librelay.a

.PHONY: all lib man test-programs test valgrind-test bench install clean services-start services-stop deb
# What ships, and only that: the test programs need libcmocka-dev (see scripts/packages.txt).
all: $(LIBA) $(LIBSO) $(RELAY) $(EXAMPLE_BIN) $(BUILD)/outbox.pc $(MAN_OUT)

# tests/c/* (cmocka) and tests/bench/* (tests/test_sink_amqp.py runs amqp_probe too)
test-programs: $(TEST_BIN) $(BENCH_BIN)

man: $(MAN_OUT)

lib: $(LIBA) $(LIBSO)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(LIBA): $(LIB_OBJ)
	@rm -f $@
	$(AR) rcs $@ $^

# lib/liboutbox.map: the shared library exports the installed headers' API only
$(LIBSO): $(LIB_OBJ) lib/liboutbox.map
	$(CC) -shared -Wl,-soname,liboutbox.so.$(SOMAJOR) -Wl,--version-script=lib/liboutbox.map \
	    $(ALL_LDFLAGS) -o $@ $(LIB_OBJ) $(LIB_LIBS)
	ln -sf liboutbox.so.$(SOVERSION) $(BUILD)/liboutbox.so.$(SOMAJOR)
	ln -sf liboutbox.so.$(SOMAJOR) $(BUILD)/liboutbox.so

$(RELAYA): $(RELAY_OBJ)
	@rm -f $@
	$(AR) rcs $@ $^

$(RELAY): $(MAIN_OBJ) $(RELAYA) $(LIBA)
	$(CC) $(ALL_LDFLAGS) -o $@ $(MAIN_OBJ) $(RELAYA) $(LIBA) $(RELAY_LIBS)

$(BUILD)/tests/%: tests/c/%.c $(RELAYA) $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS) -o $@ $< $(RELAYA) $(LIBA) $(RELAY_LIBS) -lcmocka

$(BUILD)/tests/%: tests/bench/%.c $(RELAYA) $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS) -o $@ $< $(RELAYA) $(LIBA) $(RELAY_LIBS)

# Examples link only liboutbox, as an application would.
$(BUILD)/examples/%: examples/%.c $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS) -o $@ $< $(LIBA) $(LIB_LIBS)

$(BUILD)/outbox.pc: lib/outbox.pc.in Makefile
	@mkdir -p $(dir $@)
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' $< > $@

# The man pages carry the version in their title line.
$(BUILD)/man/%: man/% Makefile
	@mkdir -p $(dir $@)
	sed -e 's|@VERSION@|$(VERSION)|g' $< > $@

# Tests: private services are started by the harness (tests/conftest.py) when not running.
TESTS ?= tests
test: all test-programs
	OUTBOX_BUILD=$(abspath $(BUILD)) OUTBOX_VALGRIND=$(VALGRIND) $(PYTHON) -m pytest -ra $(TESTS) $(PYTEST_ARGS)

# The daemon under valgrind over its end-to-end tests (a subset: the whole suite under
# valgrind is slow); any valgrind error or definite leak makes the relay exit 99 and its test fail.
# test_relay_silent_host_big_row.py adds, in one short run, a multi-host conninfo past a silent
# host (init's and the loop's connects), payloads read in 1 MiB slices and the loop's timing.
VALGRIND_TESTS ?= tests/test_relay.py tests/test_relay_two_outboxes.py tests/test_relay_reload.py \
                  tests/test_relay_silent_host_big_row.py
valgrind-test:
	$(MAKE) test VALGRIND=1 SANITIZER= TESTS="$(VALGRIND_TESTS)"

bench: all $(BENCH_BIN)
	OUTBOX_BUILD=$(abspath $(BUILD)) $(PYTHON) tests/bench/bench.py

# The files kept in .clang-format's style (scripts/test.sh runs format-check): add a file
# here once it is formatted. `make format` rewrites them.
CLANG_FORMAT ?= clang-format
FORMATTED := lib/util.c lib/outbox_util.h \
             config/cfg.c config/cfg.h config/cfg_lines.c config/cfg_loader.h \
             config/cfg_secret.c config/cfg_value.c \
             sinks/rabbitmq/amqpcfg.c sinks/rabbitmq/amqpcfg.h \
             sinks/rabbitmq/amqpconnect.c sinks/rabbitmq/amqpconnect.h \
             sinks/rabbitmq/amqpsink.c sinks/rabbitmq/amqpsink.h \
             sinks/rabbitmq/amqpwire.c sinks/rabbitmq/amqpxcheck.c sinks/rabbitmq/json.h \
             sources/pg/pgsrc_rows.c sources/pg/pgsrc_hosts.c relay/looptime.c relay/looptime.h sources/odbc/odbcsrc_health.c
.PHONY: format format-check
format-check:
	$(CLANG_FORMAT) --dry-run --Werror $(FORMATTED)
format:
	$(CLANG_FORMAT) -i $(FORMATTED)

services-start:
	scripts/services.sh start
services-stop:
	scripts/services.sh stop

MANDIR ?= $(PREFIX)/share/man
install: $(LIBA) $(LIBSO) $(RELAY) $(MAN_OUT)
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin \
		$(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man5
	install -m 644 lib/outbox_pg.h lib/outbox_odbc.h $(DESTDIR)$(PREFIX)/include/
	# outbox.h's OUTBOX_VERSION_STRING is written from VERSION, the version's one place
	sed 's|^#define OUTBOX_VERSION_STRING ".*"$$|#define OUTBOX_VERSION_STRING "$(VERSION)"|' \
		lib/outbox.h > $(DESTDIR)$(PREFIX)/include/outbox.h
	grep -qx '#define OUTBOX_VERSION_STRING "$(VERSION)"' $(DESTDIR)$(PREFIX)/include/outbox.h
	chmod 644 $(DESTDIR)$(PREFIX)/include/outbox.h
	install -m 644 $(LIBA) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(LIBSO) $(DESTDIR)$(PREFIX)/lib/
	ln -sf liboutbox.so.$(SOVERSION) $(DESTDIR)$(PREFIX)/lib/liboutbox.so.$(SOMAJOR)
	ln -sf liboutbox.so.$(SOMAJOR) $(DESTDIR)$(PREFIX)/lib/liboutbox.so
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' lib/outbox.pc.in \
		> $(DESTDIR)$(PREFIX)/lib/pkgconfig/outbox.pc
	chmod 644 $(DESTDIR)$(PREFIX)/lib/pkgconfig/outbox.pc
	install -m 755 $(RELAY) $(DESTDIR)$(PREFIX)/bin/
	install -m 644 $(BUILD)/man/outbox-relay.1 $(DESTDIR)$(MANDIR)/man1/
	install -m 644 $(BUILD)/man/outbox-relay.ini.5 $(DESTDIR)$(MANDIR)/man5/

# Debian packages. dpkg-buildpackage builds in a copy of the tree under build/deb/ (the tree's
# top level has no debian/: deploy/debian/ is copied there), with debian/changelog written from
# VERSION (`make install` writes outbox.h's version), so that the packages carry one version; the three
# packages land in build/, the source package (.dsc, .tar.xz), .changes, .buildinfo and the
# debug symbol packages (*-dbgsym) stay in build/deb/. The changelog's date is the last
# commit's, so that a rebuild of the same commit gives the same packages.
DEB_DIR := build/deb
DEB_SRC := $(DEB_DIR)/outbox-relay-$(VERSION)
DEB_DATE = $(shell date -u -R -d @$$(git log -1 --format=%ct 2>/dev/null || date +%s))
deb:
	rm -rf $(DEB_DIR)
	rm -f build/outbox-relay_*.deb build/liboutbox1_*.deb build/liboutbox-dev_*.deb \
		build/*-dbgsym_*.deb
	mkdir -p $(DEB_SRC)
	tar -c --exclude=./build --exclude='./build-*' --exclude='./.services*' --exclude=./.git \
		--exclude='__pycache__' --exclude='.pytest_cache' . | tar -x -C $(DEB_SRC)
	cp -R deploy/debian $(DEB_SRC)/debian
	sed -e 's|@VERSION@|$(VERSION)|g' -e 's|@DATE@|$(DEB_DATE)|g' deploy/debian/changelog.in \
		> $(DEB_SRC)/debian/changelog
	rm $(DEB_SRC)/debian/changelog.in
	cd $(DEB_SRC) && DEB_BUILD_OPTIONS="$${DEB_BUILD_OPTIONS:-parallel=2}" \
		dpkg-buildpackage --build=full --no-sign
	for p in outbox-relay liboutbox1 liboutbox-dev; do mv $(DEB_DIR)/$${p}_*.deb build/ || exit 1; done
	@ls -1 build/*.deb

clean:
	rm -rf build build-address build-undefined build-address+undefined

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

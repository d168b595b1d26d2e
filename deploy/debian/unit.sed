# deploy/outbox-relay.service → the unit of the outbox-relay package: the package's paths,
# no manual installation steps, and a condition that skips the service until relay.ini names
# an outbox (it is installed with every setting commented out).
1c\
# systemd unit for outbox-relay, installed by the outbox-relay package. Configure\
# /etc/outbox-relay/relay.ini, then: systemctl start outbox-relay
/^#   /d
s|/usr/local/bin/outbox-relay|/usr/bin/outbox-relay|g
s|^Documentation=.*|Documentation=man:outbox-relay(1) man:outbox-relay.ini(5)|
/^ExecStart=/i\
# Skipped (not failed) while relay.ini has no [outbox.NAME] section: the package installs it\
# with every setting commented out. A relay.ini the service cannot read (missing, or its\
# mode) fails the unit instead (exit 255), as the relay would.\
ExecCondition=/bin/sh -c 'grep -Eqi "^[[:space:]]*[[][[:space:]]*outbox[.]" "$$1" || { test -r "$$1" \&\& exit 1; exit 255; }' sh /etc/outbox-relay/relay.ini

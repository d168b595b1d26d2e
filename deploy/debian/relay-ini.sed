# config/relay.example.ini → /etc/outbox-relay/relay.ini: every setting commented out with
# "#" (the explanations keep their ";"), under a header saying how to configure the service.
1s/ ([^)]*)\././
2s/config\/README.md documents each one/man 5 outbox-relay.ini documents each one/
1i\
; /etc/outbox-relay/relay.ini: the configuration of the outbox-relay service, which runs\
;   outbox-relay run -c /etc/outbox-relay/relay.ini\
; as the user outbox-relay.\
;\
; Every setting below is commented out with "#". The service is enabled, but it is\
; skipped (not started, not failed) until this file has an [outbox.NAME] section. Remove\
; the "#" of the lines you need, set the outbox's conninfo and database and the sink's url,\
; then:\
;   outbox-relay init  -c /etc/outbox-relay/relay.ini    # create the outbox table, once\
;   outbox-relay check -c /etc/outbox-relay/relay.ini\
;   systemctl start outbox-relay\
; Keep passwords in files only the outbox-relay user can read (password_file = ...).\
; man 5 outbox-relay.ini describes every key.\
;
/^[[:space:]]*;/b
/^[[:space:]]*$/b
s/^/#/

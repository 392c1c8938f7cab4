DROP TABLE IF EXISTS outbox_migrations;
DROP TABLE IF EXISTS outbox_relay_idle;
DROP TABLE IF EXISTS consumed_msg;
DROP TABLE IF EXISTS outbox;
DROP SEQUENCE IF EXISTS outbox_id_seq;
DROP FUNCTION IF EXISTS consumed_msg_dedup();
DROP FUNCTION IF EXISTS outbox_dedup_msg_id();
DROP TABLE IF EXISTS outbox_partitioning;

DROP TABLE IF EXISTS outbox_migrations;
DROP TABLE IF EXISTS consumed_msg;
DROP TABLE IF EXISTS outbox;

-- The purge's statement shapes measured by hand on MariaDB in docs/cost-curve.md
-- ("The MariaDB purge over time-ordered history"): load into a database holding the
-- inbox table (seeded as the bench's growth phase seeds it, several days of markers
-- older than the bulk), then time one CALL per day while watching
-- SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_%', e.g.
--   CALL purge_by_received(UTC_TIMESTAMP(6) - INTERVAL 372 HOUR, 2000);
-- Several purge_by_id (disjoint id ranges) or purge_skip_locked calls on separate
-- connections at once are the "streams".

DROP PROCEDURE IF EXISTS purge_by_received;
DROP PROCEDURE IF EXISTS purge_by_id;
DROP PROCEDURE IF EXISTS purge_by_message;
DELIMITER //
-- The library's statement (inbox-core/src/backend/mysql.rs purge_batch), in a loop.
CREATE PROCEDURE purge_by_received(cutoff DATETIME(6), batch INT)
BEGIN
  DECLARE n INT DEFAULT batch;
  WHILE n = batch DO
    DELETE FROM inbox WHERE received_at < cutoff
      AND (processed_at < cutoff OR (processed_at IS NULL AND lease_until IS NULL))
      ORDER BY received_at LIMIT batch;
    SET n = ROW_COUNT();
  END WHILE;
END//
-- One stream of a parallel purge: the rows of a primary-key range, in key order.
CREATE PROCEDURE purge_by_id(cutoff DATETIME(6), batch INT, lo BIGINT, hi BIGINT)
BEGIN
  DECLARE n INT DEFAULT batch;
  WHILE n = batch DO
    DELETE FROM inbox WHERE id BETWEEN lo AND hi AND received_at < cutoff
      AND (processed_at < cutoff OR (processed_at IS NULL AND lease_until IS NULL))
      ORDER BY id LIMIT batch;
    SET n = ROW_COUNT();
  END WHILE;
END//
-- The batch in message-id order: each batch a slice of the message-id index.
CREATE PROCEDURE purge_by_message(cutoff DATETIME(6), batch INT)
BEGIN
  DECLARE n INT DEFAULT batch;
  WHILE n = batch DO
    DELETE FROM inbox WHERE received_at < cutoff
      AND (processed_at < cutoff OR (processed_at IS NULL AND lease_until IS NULL))
      ORDER BY message_id, consumer LIMIT batch;
    SET n = ROW_COUNT();
  END WHILE;
END//
DELIMITER ;

DROP PROCEDURE IF EXISTS purge_skip_locked;
DELIMITER //
-- One of several streams that need no partition: each batch locks the oldest rows no
-- other stream holds (FOR UPDATE SKIP LOCKED), then deletes them by primary key.
CREATE PROCEDURE purge_skip_locked(cutoff DATETIME(6), batch INT)
BEGIN
  DECLARE n INT DEFAULT 1;
  CREATE TEMPORARY TABLE IF NOT EXISTS picked (id BIGINT PRIMARY KEY) ENGINE=MEMORY;
  WHILE n > 0 DO
    DELETE FROM picked;
    START TRANSACTION;
    INSERT INTO picked SELECT id FROM inbox WHERE received_at < cutoff
      AND (processed_at < cutoff OR (processed_at IS NULL AND lease_until IS NULL))
      ORDER BY received_at LIMIT batch FOR UPDATE SKIP LOCKED;
    SET n = ROW_COUNT();
    DELETE inbox FROM inbox JOIN picked USING (id);
    COMMIT;
  END WHILE;
END//
DELIMITER ;

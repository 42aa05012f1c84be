use crate::{InboxError, MessageId};
use sea_orm_inbox_entity::CONSUMER_MAX_CHARS;

/// Checks a consumer name before it reaches SQL, so that a name is valid on every backend
/// or on none: non-empty, no surrounding white space (MySQL's PAD SPACE comparison would
/// make "billing" and "billing " one consumer), no NUL (PostgreSQL cannot store it in
/// text, so every claim would fail), and no longer than the column counts: `varchar(200)`
/// counts characters on PostgreSQL and on MySQL/MariaDB (utf8mb4); SQLite enforces no
/// length, and gets the same bound so that a name moves between backends.
pub(crate) fn validate_consumer(consumer: &str) -> Result<(), InboxError> {
    if consumer.trim().is_empty() {
        return Err(InboxError::EmptyConsumer);
    }
    if consumer.trim() != consumer {
        return Err(InboxError::ConsumerNotTrimmed {
            consumer: consumer.to_owned(),
        });
    }
    if consumer.contains('\0') {
        return Err(InboxError::ConsumerContainsNul {
            consumer: consumer.to_owned(),
        });
    }
    let chars = consumer.chars().count();
    if chars > CONSUMER_MAX_CHARS {
        return Err(InboxError::ConsumerTooLong { chars });
    }
    Ok(())
}

/// Checks the input of a single-message claim: the consumer name and a non-nil id.
pub(crate) fn validate_claim(message_id: MessageId, consumer: &str) -> Result<(), InboxError> {
    validate_consumer(consumer)?;
    validate_message_id(message_id)
}

/// Checks that a message id is not the nil UUID.
pub(crate) fn validate_message_id(message_id: MessageId) -> Result<(), InboxError> {
    if message_id.is_nil() {
        return Err(InboxError::NilMessageId);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_names_up_to_the_column_width_in_characters() {
        assert!(validate_consumer("billing").is_ok());
        assert!(validate_consumer(&"é".repeat(200)).is_ok());
    }

    #[test]
    fn rejects_names_with_surrounding_white_space() {
        for name in [" billing", "billing ", "billing\n"] {
            assert!(matches!(
                validate_consumer(name),
                Err(InboxError::ConsumerNotTrimmed { consumer }) if consumer == name
            ));
        }
        assert!(validate_consumer("billing credit").is_ok());
    }

    #[test]
    fn rejects_names_holding_nul() {
        for name in ["billing\0", "\0billing", "bill\0ing"] {
            assert!(matches!(
                validate_consumer(name),
                Err(InboxError::ConsumerContainsNul { consumer }) if consumer == name
            ));
        }
    }

    #[test]
    fn rejects_empty_blank_and_too_long_names() {
        assert!(matches!(
            validate_consumer(""),
            Err(InboxError::EmptyConsumer)
        ));
        assert!(matches!(
            validate_consumer("  \t"),
            Err(InboxError::EmptyConsumer)
        ));
        assert!(matches!(
            validate_consumer(&"x".repeat(201)),
            Err(InboxError::ConsumerTooLong { chars: 201 })
        ));
    }
}

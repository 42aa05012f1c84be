//! Everything a handler needs: `use inbox_core::prelude::*;`.

pub use crate::{
    CLAIM_TRANSACTION, Claim, InboxError, InboxTransactionExt, MessageId, is_inbox_duplicate,
};

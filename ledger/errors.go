package ledger

import "errors"

// Why the ledger refuses a device. A refusal wraps one of these (test with
// errors.Is): the device plugin answers the kubelet FailedPrecondition for
// all but ErrLogUnavailable, which is Unavailable (the same Allocate may
// succeed once the state dir can be written).
var (
	// ErrHeld: a container has it through the device plugin (the kubelet
	// lists it, or it was handed out and not yet listed), or the device
	// plugin handed out the same silicon under another name.
	ErrHeld = errors.New("held by a container")
	// ErrDoomed: a MIG plan is about to destroy it or change its GPU's mode.
	ErrDoomed = errors.New("being repartitioned")
	// ErrPrepared: a DRA claim holds it.
	ErrPrepared = errors.New("prepared for a DRA claim")
	// ErrIntended: a MIG device is being made there for a claim.
	ErrIntended = errors.New("being made for a DRA claim")
	// ErrReleasing: a MIG device made for a released claim, to be destroyed.
	ErrReleasing = errors.New("being released by a DRA claim")
	// ErrLogUnavailable: the allocation could not be recorded (the
	// allocation log is not open, or the write failed), so a restart would
	// not know it.
	ErrLogUnavailable = errors.New("allocation log unavailable")
)

// RefusedError is a device the ledger refused, and why.
type RefusedError struct {
	// Device names the device: its UUID, or its DRA name and UUID; empty
	// where the caller names it.
	Device string
	// Reason is one of the Err values above.
	Reason error
	// Detail says why in words, naming the holder: "being repartitioned:
	// MIG layout all-1g.10gb on GPU 0".
	Detail string
}

func (e *RefusedError) Error() string {
	if e.Device == "" {
		return e.Detail
	}
	return "device " + e.Device + " is " + e.Detail
}

// Unwrap is the reason, for errors.Is.
func (e *RefusedError) Unwrap() error { return e.Reason }

// refused is a RefusedError.
func refused(device string, reason error, detail string) error {
	return &RefusedError{Device: device, Reason: reason, Detail: detail}
}

// logUnavailable is an allocation not recorded: it is ErrLogUnavailable,
// and says why in its own words.
type logUnavailable struct{ error }

func (e logUnavailable) Is(target error) bool { return target == ErrLogUnavailable }
func (e logUnavailable) Unwrap() error        { return e.error }

package telemetry

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"time"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// bucketLen is the resolution of the windowed averages: a day of 5-minute
// buckets is 288 per holder and device, so 8 GPUs × 48 replicas keep a
// state file of about 3 MB at most.
const (
	bucketLen = 5 * time.Minute
	windowMax = 24 * time.Hour
)

// bucket is the time a holder held its device within one bucketLen, and
// its SM utilization over that time (% × seconds).
type bucket struct {
	at      int64 // unix seconds of the bucket's start
	held    float64
	smTotal float64
}

// window is a holder's buckets of the last windowMax, oldest first.
type window []bucket

// add counts dt of holding, at sm %, into the bucket of now.
func (w *window) add(now time.Time, dt time.Duration, sm float64) {
	at := now.Truncate(bucketLen).Unix()
	b := *w
	if n := len(b); n > 0 && b[n-1].at >= at {
		// This bucket, or a later one when the clock stepped back: the
		// time still counts, in the newest.
		b[n-1].held += dt.Seconds()
		b[n-1].smTotal += sm * dt.Seconds()
	} else {
		b = append(b, bucket{at: at, held: dt.Seconds(), smTotal: sm * dt.Seconds()})
	}
	cut := now.Add(-windowMax - bucketLen).Unix()
	i := 0
	for i < len(b) && b[i].at < cut {
		i++
	}
	*w = b[i:]
}

// avg is the mean SM % over the time held in the buckets that end within
// span of now; false when none does.
func (w window) avg(now time.Time, span time.Duration) (float64, bool) {
	from := now.Add(-span).Unix()
	var held, total float64
	for _, b := range w {
		if b.at+int64(bucketLen/time.Second) > from {
			held += b.held
			total += b.smTotal
		}
	}
	if held <= 0 {
		return 0, false
	}
	return total / held, true
}

// The state file of the HolderTracker.
const (
	// HolderStateFile is its name in the agent's state directory.
	HolderStateFile = "holders.json"
	// holderStateVersion is written; every version from 1 on is read, a
	// later one for the fields it shares with this one (the format only
	// grows; unknown fields are ignored).
	holderStateVersion = 1
	maxHolderState     = 32 << 20
	// maxHolderRecords bounds what a file may make the agent keep: far
	// above 8 GPUs × 48 replicas × a few claims.
	maxHolderRecords = 16384
)

type holderFile struct {
	Version int            `json:"version"`
	Holders []holderRecord `json:"holders"`
}

// holderRecord is one holder on one device.
type holderRecord struct {
	Device         string    `json:"device"`
	Namespace      string    `json:"namespace"`
	Pod            string    `json:"pod"`
	Container      string    `json:"container"`
	ClaimNamespace string    `json:"claimNamespace,omitempty"`
	ClaimName      string    `json:"claimName,omitempty"`
	Driver         string    `json:"driver,omitempty"`
	Pool           string    `json:"pool,omitempty"`
	ClaimDevice    string    `json:"claimDevice,omitempty"`
	MIGProfile     string    `json:"migProfile,omitempty"`
	MIGUUID        string    `json:"migUUID,omitempty"`
	FirstSeen      time.Time `json:"firstSeen"`
	LastActive     time.Time `json:"lastActive,omitzero"`
	IdleNoticeSent time.Time `json:"idleNoticeSent,omitzero"`
	// Buckets are [start (unix s), seconds held, SM % × seconds].
	Buckets [][3]float64 `json:"buckets,omitempty"`
}

// encodeHolderState writes state as the file holds it.
func encodeHolderState(state map[holderKey]*holderState) ([]byte, error) {
	f := holderFile{Version: holderStateVersion, Holders: make([]holderRecord, 0, len(state))}
	for k, st := range state {
		h := k.h
		r := holderRecord{Device: k.device, Namespace: h.Namespace, Pod: h.Pod, Container: h.Container,
			ClaimNamespace: h.claim.ClaimNamespace, ClaimName: h.claim.ClaimName, Driver: h.claim.Driver, Pool: h.claim.Pool,
			ClaimDevice: h.claim.Device, MIGProfile: h.migProfile, MIGUUID: h.migUUID,
			FirstSeen: st.firstSeen, LastActive: st.lastActive, IdleNoticeSent: st.notified}
		for _, b := range st.win {
			r.Buckets = append(r.Buckets, [3]float64{float64(b.at), b.held, b.smTotal})
		}
		f.Holders = append(f.Holders, r)
	}
	return json.Marshal(f)
}

// decodeHolderState reads a state file's content. Buckets that cannot be
// (negative, not finite, more time than a bucket has, out of order) are
// dropped, not the file: they are averages, not decisions.
func decodeHolderState(data []byte) (map[holderKey]*holderState, error) {
	var f holderFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	if f.Version < 1 {
		return nil, fmt.Errorf("version %d: want %d or later", f.Version, holderStateVersion)
	}
	if len(f.Holders) > maxHolderRecords {
		return nil, fmt.Errorf("%d holders, more than %d", len(f.Holders), maxHolderRecords)
	}
	out := make(map[holderKey]*holderState, len(f.Holders))
	for _, r := range f.Holders {
		if r.Device == "" {
			continue
		}
		h := seriesHolder{Holder: podresources.Holder{Namespace: r.Namespace, Pod: r.Pod, Container: r.Container},
			migProfile: r.MIGProfile, migUUID: r.MIGUUID}
		if r.ClaimName != "" {
			h.claim = podresources.DRAHold{Holder: h.Holder, ClaimNamespace: r.ClaimNamespace, ClaimName: r.ClaimName,
				Driver: r.Driver, Pool: r.Pool, Device: r.ClaimDevice}
		}
		st := &holderState{firstSeen: r.FirstSeen, lastActive: r.LastActive, notified: r.IdleNoticeSent}
		for _, b := range r.Buckets {
			at, held, sm := b[0], b[1], b[2]
			ok := !math.IsNaN(at) && !math.IsInf(at, 0) && at >= 0 && at < math.MaxInt64/2 &&
				held >= 0 && held <= 2*bucketLen.Seconds() && sm >= 0 && sm <= 100*held
			if !ok || (len(st.win) > 0 && int64(at) <= st.win[len(st.win)-1].at) {
				continue
			}
			st.win = append(st.win, bucket{at: int64(at), held: held, smTotal: sm})
		}
		out[holderKey{r.Device, h}] = st
	}
	return out, nil
}

// loadHolderState reads the state file; none yet is no error.
func loadHolderState(path string) (map[holderKey]*holderState, error) {
	data, err := atomicfile.ReadFile(path, maxHolderState)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	st, err := decodeHolderState(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return st, nil
}

// save writes the state file, if the tracker keeps one; a failure is kept
// for SaveError and tried again at the next pass.
func (t *HolderTracker) save(now time.Time) {
	if t.opts.StatePath == "" {
		return
	}
	data, err := encodeHolderState(t.state)
	if err == nil {
		err = atomicfile.Write(t.opts.StatePath, data)
	}
	if err != nil {
		err = fmt.Errorf("holder state %s: %w", t.opts.StatePath, err)
		t.opts.Logger.Warn("holder state not saved", "error", err)
		t.saveErr.Store(&err)
		return
	}
	t.saveErr.Store(nil)
	t.dirty, t.lastSave = false, now
}

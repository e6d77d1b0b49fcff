package ledger

import (
	"maps"
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// Snapshot is what of the ledger the agent's checkpoint keeps: its DRA
// side. The device plugin's allocations have a file of their own (the
// allocation log), written before Allocate answers.
type Snapshot struct {
	// Claims are the prepared claims, Releasing what released claims
	// left to undo and Intents the MIG devices being made for claims, by
	// claim UID; DynamicMIG the GPUs whose MIG mode a claim turned on,
	// sorted.
	Claims     map[types.UID]Claim
	Releasing  map[types.UID]Claim
	Intents    map[types.UID]Claim
	DynamicMIG []string
	// Allocated are allocations of the device plugin, by device UUID, that
	// checkpoints before the allocation log kept (versions 1 and 2);
	// Snapshot leaves it empty.
	Allocated map[string]time.Time
}

// Snapshot copies what the checkpoint keeps of the ledger. Maps that are
// empty are nil, so that the checkpoint leaves them out.
func (l *Ledger) Snapshot() Snapshot {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := Snapshot{}
	if len(l.claims) > 0 {
		s.Claims = cloneClaims(l.claims)
	}
	if len(l.releases) > 0 {
		s.Releasing = cloneClaims(l.releases)
	}
	if len(l.intents) > 0 {
		s.Intents = cloneClaims(l.intents)
	}
	if len(l.dynamicMIG) > 0 {
		s.DynamicMIG = slices.Sorted(maps.Keys(l.dynamicMIG))
	}
	return s
}

// Restore takes what an earlier agent checkpointed, over what the ledger
// holds. An intent found after a crash is undone like a release: the
// kubelet never heard of its device and asks again. An allocation dated
// after now (the clock stepped back across the restart) counts from now;
// future says how many did.
func (l *Ledger) Restore(s Snapshot) (future int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	allocs := make(map[string]AllocEntry, len(s.Allocated))
	for u, at := range s.Allocated {
		allocs[u] = AllocEntry{At: at} // under a name the checkpoint did not keep
	}
	future = l.restoreAllocationsLocked(allocs)
	for uid, c := range s.Claims {
		l.claims[uid] = c.clone()
	}
	for uid, c := range s.Releasing {
		l.releases[uid] = c.clone()
	}
	// One whose claim was checkpointed with it holds nothing the claim
	// holds (the agent's destroyPartition leaves it).
	for uid, c := range s.Intents {
		rel := l.releases[uid]
		rel.Namespace, rel.Name, rel.At = c.Namespace, c.Name, c.At
		rel.Devices = append(rel.Devices, c.Devices...)
		l.releases[uid] = rel
	}
	for _, uuid := range s.DynamicMIG {
		l.dynamicMIG[uuid] = true
	}
	return future
}

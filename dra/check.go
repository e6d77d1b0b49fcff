package dra

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/resourceslice"
)

// CheckSoon asks for a check of the API server's ResourceSlices before the
// next periodic one (at most one waits).
func (d *Driver) CheckSoon() {
	select {
	case d.checkNow <- struct{}{}:
	default:
	}
}

// checkLoop runs CheckSlices every SliceCheck, sooner when asked
// (CheckSoon), and again SliceCheckGap after a check that found the slices not
// ours, so that the second finding that starts publishing over comes
// seconds after the first rather than a SliceCheck later; until ctx ends.
func (d *Driver) checkLoop(ctx context.Context) {
	tick := time.NewTicker(d.opts.SliceCheck)
	defer tick.Stop()
	confirm := false
	for {
		if !confirm {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			case <-d.checkNow:
			}
		}
		if err := d.CheckSlices(ctx); err != nil && ctx.Err() == nil {
			d.log.Warn("DRA: cannot compare the API server's ResourceSlices with the ones published", "err", err)
		}
		d.mu.Lock()
		confirm = d.notOurs > 0
		d.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-time.After(d.opts.SliceCheckGap):
		}
	}
}

// CheckSlices compares the API server's ResourceSlices of this node with the
// pool last handed to the controller (device and counter set names, and
// the Node that owns them), and says on /status (Slices) how they differ.
// A difference found by two checks in a row starts publishing over
// (runPublishing), once the Node exists: the controller had time to write
// what it was handed, so its cache is not what the API server has.
func (d *Driver) CheckSlices(ctx context.Context) error {
	d.mu.Lock()
	running, handed := d.controller, d.handed
	d.mu.Unlock()
	if running == nil {
		return nil // starting: the controller reads the API server as it starts
	}
	sel := fields.Set{resourceapi.ResourceSliceSelectorDriver: devicemodel.DriverName, resourceapi.ResourceSliceSelectorNodeName: d.opts.NodeName}
	list, err := d.opts.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: sel.String()})
	if err != nil {
		return d.checkFailed(fmt.Errorf("list the ResourceSlices of node %s: %w", d.opts.NodeName, err))
	}
	var nodeUID types.UID
	switch node, err := d.opts.Client.CoreV1().Nodes().Get(ctx, d.opts.NodeName, metav1.GetOptions{}); {
	case apierrors.IsNotFound(err):
		// Nothing can be published for it: no restart until it is back.
	case err != nil:
		return d.checkFailed(fmt.Errorf("read node %s: %w", d.opts.NodeName, err))
	default:
		nodeUID = node.UID
	}
	why, foreign := notOurs(d.opts.NodeName, handed, list.Items, nodeUID)
	if why != "" && nodeUID == "" {
		why += "; the Node " + d.opts.NodeName + " does not exist"
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	now := d.opts.Now()
	d.slices.Checked, d.slices.CheckError = now, ""
	if why == "" {
		d.slices.NotOurs, d.slices.NotOursSince, d.notOurs = "", time.Time{}, 0
		return nil
	}
	if d.slices.NotOursSince.IsZero() {
		d.slices.NotOursSince = now
	}
	d.slices.NotOurs = why
	d.notOurs++
	d.log.Warn("DRA: the API server's ResourceSlices are not the ones published", "why", why, "checks", d.notOurs)
	if d.notOurs < 2 || nodeUID == "" || d.controller != running {
		return nil
	}
	select {
	case d.restart <- foreign:
		d.notOurs = 0
		d.slices.Restarts++
	default: // one is pending
	}
	return nil
}

func (d *Driver) checkFailed(err error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.slices.Checked, d.slices.CheckError = d.opts.Now(), err.Error()
	return err
}

// notOurs says how the API server's slices of this node (api) differ from
// pool, the one the controller was handed: "" when they hold the same
// devices and counter sets, all in slices of the newest generation and
// owned by the Node of UID nodeUID (not compared when ""). foreign are the
// slices owned by another Node.
func notOurs(poolName string, pool resourceslice.Pool, api []resourceapi.ResourceSlice, nodeUID types.UID) (why string, foreign []resourceapi.ResourceSlice) {
	mine := func(s resourceapi.ResourceSlice) bool {
		return s.Spec.Driver == devicemodel.DriverName && s.Spec.Pool.Name == poolName && s.Spec.NodeName != nil && *s.Spec.NodeName == poolName
	}
	var gen int64
	for _, s := range api {
		if mine(s) {
			gen = max(gen, s.Spec.Pool.Generation)
		}
	}
	var reasons []string
	have := map[string]bool{}
	current := 0
	for _, s := range api {
		if !mine(s) {
			continue
		}
		if owner := nodeOwner(s); nodeUID != "" && owner != nodeUID {
			foreign = append(foreign, s)
			reasons = append(reasons, fmt.Sprintf("ResourceSlice %s is owned by Node UID %q, the Node's is %s", s.Name, owner, nodeUID))
			continue
		}
		if s.Spec.Pool.Generation < gen {
			continue // obsolete: the controller deletes it
		}
		current++
		for _, dev := range s.Spec.Devices {
			have["device "+dev.Name] = true
		}
		for _, cs := range s.Spec.SharedCounters {
			have["counter set "+cs.Name] = true
		}
	}
	if current < len(pool.Slices) {
		reasons = append(reasons, fmt.Sprintf("the API server has %d of the %d ResourceSlices published", current, len(pool.Slices)))
	}
	var missing []string
	for _, s := range pool.Slices {
		for _, dev := range s.Devices {
			if !have["device "+dev.Name] {
				missing = append(missing, dev.Name)
			}
			delete(have, "device "+dev.Name)
		}
		for _, cs := range s.SharedCounters {
			if !have["counter set "+cs.Name] {
				missing = append(missing, "counter set "+cs.Name)
			}
			delete(have, "counter set "+cs.Name)
		}
	}
	if len(missing) > 0 {
		reasons = append(reasons, fmt.Sprintf("%d published not in them (%s)", len(missing), firstFew(missing)))
	}
	if len(have) > 0 {
		extra := make([]string, 0, len(have))
		for k := range have {
			extra = append(extra, k)
		}
		slices.Sort(extra)
		reasons = append(reasons, fmt.Sprintf("%d in them not published (%s)", len(extra), firstFew(extra)))
	}
	return strings.Join(reasons, "; "), foreign
}

// nodeOwner is the UID of the Node that controls s ("" for none).
func nodeOwner(s resourceapi.ResourceSlice) types.UID {
	for _, o := range s.OwnerReferences {
		if o.APIVersion == "v1" && o.Kind == "Node" && o.Controller != nil && *o.Controller {
			return o.UID
		}
	}
	return ""
}

// firstFew lists at most 5 of names, so that /status stays short when a
// whole pool is missing.
func firstFew(names []string) string {
	if len(names) <= 5 {
		return strings.Join(names, ", ")
	}
	return strings.Join(names[:5], ", ") + fmt.Sprintf(" and %d more", len(names)-5)
}

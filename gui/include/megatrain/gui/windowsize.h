// The --size WIDTHxHEIGHT value of megatrain-gui, parsed and bounded in one place (the app and its
// test use it).
#pragma once

#include <QSize>
#include <QString>

namespace megatrain::gui {

// 200 px: below it the lanes and the summary do not fit. 16384 px: a 16384 x 16384 ARGB32 window
// image is 1 GiB, the most one screenshot may take in memory, and 16384 is the largest texture
// side of common GPUs and half the X11 window limit (32767). Past it the raster engine cannot back
// the window and Qt prints a QPainter warning per widget instead of an error.
constexpr int kMinWindowSide = 200;
constexpr int kMaxWindowSide = 16384;

// The size in "WIDTHxHEIGHT" (e.g. 1600x1000), or an invalid QSize with *error set to a message
// that names --size, the bound and the value: "--size: width must be at most 16384 (got 100000);
// accepted: WIDTHxHEIGHT, each side 200 to 16384 pixels".
QSize parseWindowSize(const QString& text, QString* error);

}  // namespace megatrain::gui

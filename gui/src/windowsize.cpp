// parseWindowSize: the --size value, with core/flags.h's range message for each side.
#include "megatrain/gui/windowsize.h"

#include <QStringList>

#include "megatrain/core/flags.h"

namespace megatrain::gui {

QSize parseWindowSize(const QString& text, QString* error) {
  const QString accepted =
      QStringLiteral("accepted: WIDTHxHEIGHT, each side %1 to %2 pixels").arg(kMinWindowSide).arg(kMaxWindowSide);
  const QStringList wh = text.split(QLatin1Char('x'));
  if (wh.size() != 2) {
    *error = QStringLiteral("--size: expected WIDTHxHEIGHT (got '%1'); %2").arg(text, accepted);
    return {};
  }
  int side[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    const std::string why = int_flag_error(wh[i].toStdString(), kMinWindowSide, kMaxWindowSide);
    if (!why.empty()) {
      *error = QStringLiteral("--size: %1 %2; %3").arg(QLatin1String(i == 0 ? "width" : "height"), QString::fromStdString(why), accepted);
      return {};
    }
    side[i] = wh[i].toInt();
  }
  return {side[0], side[1]};
}

}  // namespace megatrain::gui
